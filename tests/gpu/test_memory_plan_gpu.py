"""The memory plan on a GPU: the estimate of the device peak within 20% of ``torch.cuda.max_memory_allocated``
for the same configs the CPU test measures (``benchmarks/memory_plan.py --quick``), and a GPU process's plan
puts the model states on the GPU and the offloaded ones on the host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.testing.env import child_env

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_estimates_within_20_percent_of_max_memory_allocated(tmp_path: Path) -> None:
    out = tmp_path / "table.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory_plan.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=child_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows, done.stdout
    wrong = [row for row in rows if abs(row["error"]) > 0.20]
    assert not wrong, done.stdout
