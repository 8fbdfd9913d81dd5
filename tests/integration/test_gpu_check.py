"""The GPU check cannot rot: its dry run (``bash benchmarks/gpu_check.sh --dry-run``) runs every step of the
GPU run on this CPU at tiny sizes (the carried packages checked, the environment imported, the throughput
runners on the same rows with their memory plans, tests/gpu collected, the report written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.testing.env import child_env

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # make test-slow (CI runs it)
def test_the_dry_run_runs_every_step_and_writes_the_report(tmp_path: Path) -> None:
    env = {**child_env(), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    command = ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--work", str(tmp_path / "w")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    steps = report["steps"]
    assert report["dry_run"] and {n: s["status"] for n, s in steps.items()} == {
        "install": "ok",
        "environment": "ok",
        "throughput": "ok",
        "tests": "ok",
        "vllm": "skipped",
    }
    assert len(steps["install"]["data"]["requirements"]) == 17  # what make gpu-wheels fetches, all here
    runs = steps["throughput"]["data"]["results"]
    assert set(runs) == {"bare-bf16/packed", "posttrain/packed", "posttrain/compile", "posttrain/fp8-compile"}
    assert len({run["tokens"] for run in runs.values()}) == 1  # the same rows for every runner
    for name, run in runs.items():
        assert run["tokens_per_second"] > 0 and run["steps_timed"] == 2 and run["peak_memory_gib"] > 0
        assert ("plan_gib" in run) == name.startswith("posttrain") and run.get("plan_gib", 1) > 0
    outcomes = steps["tests"]["data"]["outcomes"]
    assert outcomes and set(outcomes.values()) == {"SKIPPED"}  # collected and imported; no GPU here
    assert any("test_fp8_gpu.py" in name for name in outcomes)
    assert "its wheel" in steps["vllm"]["detail"]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| fp8 with compile >= 1.2x bf16 with compile |" in table and "not judged" in table
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "environment.log",
        "results.json",
        "table.md",
        "tests.log",
        "throughput.json",
        "throughput.log",
    ]  # within what the device tool brings back: 8 files, no deeper folders
