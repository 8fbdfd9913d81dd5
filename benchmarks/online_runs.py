"""What the online-method benchmarks (``grpo_step.py``, ``distill_step.py``) share: TRL installed on demand
(it is not a dependency), each runner in a fresh process of the calling script, alternating rounds per size,
and the results kept as data for the script's table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def arguments(doc: str, sizes: str, runners: str) -> argparse.Namespace:
    """The benchmarks' command line: sizes, steps, completion length, rounds, runners, a JSON file (and the
    child mode a runner's process starts in)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--size", default=sizes, help=f"of {sizes} (comma-separated)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is warm-up)")
    parser.add_argument("--completion", type=int, default=32, help="max_completion_length")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per size")
    parser.add_argument("--runners", default=runners)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def ensure_trl() -> bool:
    """TRL importable, installed with pip (under the constraints) when missing and the index is reachable."""
    try:
        import trl  # noqa: F401

        return True
    except ImportError:
        pass
    command = [sys.executable, "-m", "pip", "install", "-q", "trl", "-c", str(ROOT / "constraints.txt")]
    print("installing trl (not a dependency of posttrain) for its runner ...", file=sys.stderr)
    return subprocess.run(command, capture_output=True).returncode == 0


def spawn(script: str, runner: str, size: str, args: argparse.Namespace, work: Path) -> dict | None:
    """One runner's figures from a fresh process of ``script`` (its ``--child`` mode), or None if it failed."""
    command = [sys.executable, script, "--child", runner, "--size", size, "--work", str(work)]
    command += ["--steps", str(args.steps), "--completion", str(args.completion)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        print(f"{runner} ({size}) failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_rounds(script: str, runners: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Every size's rounds, runners alternating within a round, each round printed as it ends; the results
    (machine, date, each ``size/runner``'s rounds) and the runs that failed."""
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {__import__('torch').__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "rounds": {},
    }
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.size.split(","):
            work = Path(tmp) / size
            work.mkdir()
            for round_number in range(args.rounds):
                for runner in runners:
                    found = spawn(script, runner, size, args, work)
                    key = f"{size}/{runner}"
                    if found is None:
                        failed.append(key)
                        continue
                    results["rounds"].setdefault(key, []).append(found)
                    print(f"{key} round {round_number + 1}: {json.dumps(found)}", flush=True)
    return results, failed


def finish(results: dict[str, Any], failed: list[str], json_path: str | None) -> None:
    """The results written as JSON when asked; exit 1 naming the failed runs."""
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}")
