"""Run ``benchmarks/memory_plan.py --quick`` (estimate against measured peak) for the CPU and GPU tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from posttrain.testing.env import child_env

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_plan.py"


def quick_table(tmp_path: Path, timeout: int = 900) -> tuple[list[dict[str, Any]], str]:
    """The rows of the quick cases (each with ``error``, estimate / measured - 1) and what it printed."""
    out = tmp_path / "table.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--jobs", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),  # the children start their own process groups
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout
