#!/usr/bin/env bash
# The one command for a lent GPU machine (benchmarks/gpu_check.py says what it runs):
#   bash benchmarks/gpu_check.sh             on the GPU machine, with .gpu/ carried (make gpu-wheels fills it)
#   bash benchmarks/gpu_check.sh --dry-run   on any machine: the same steps at tiny sizes on the CPU
# Results (results.json, table.md, logs) go to $OUT, else gpu-check-out/. Never installs a torch.
set -uo pipefail
cd "$(dirname "$0")/.."
# the image's python3 there; the project's venv for a dry run here (PYTHON=... chooses another)
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] && [ "${1:-}" = "--dry-run" ]; then PYTHON=.venv/bin/python; fi
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
