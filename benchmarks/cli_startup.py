"""CPU time of the commands that should answer at once: ``posttrain init``, ``validate`` and ``schema``.

Each command runs in a fresh process (best of ``--repeat``), its CPU time (user + system) read from the
children's resource usage; the baseline, measured in the same run, is a Python process that imports nothing
(``python -c pass``). The goal (issue #25): under 2 s of CPU each. A config with ``model.peft_config`` is
shown apart: checking it with PEFT's own classes imports PEFT, which imports torch and transformers.

    python benchmarks/cli_startup.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from posttrain.testing.env import child_env


def cpu_seconds(command: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, check=True, capture_output=True, env=child_env(), timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cli-startup-"))
    cli = [sys.executable, "-m", "posttrain"]
    subprocess.run([*cli, "init", "lora", "-o", str(work / "lora.yaml")], check=True, capture_output=True)
    counter = iter(range(10**6))
    commands = {
        "python -c pass (baseline)": lambda: [sys.executable, "-c", "pass"],
        "posttrain init sft": lambda: [
            *cli,
            "init",
            "sft",
            "-o",
            str(work / f"sft{next(counter)}" / "run.yaml"),
        ],
        "posttrain validate (sft starter)": lambda: [*cli, "validate", str(work / "sft0" / "run.yaml")],
        "posttrain schema": lambda: [*cli, "schema"],
        "posttrain validate (lora starter: imports PEFT)": lambda: [
            *cli,
            "validate",
            str(work / "lora.yaml"),
        ],
    }
    rows = {name: min(cpu_seconds(make()) for _ in range(args.repeat)) for name, make in commands.items()}
    baseline = rows["python -c pass (baseline)"]
    print(f"{'command':<50} {'CPU s':>7} {'x baseline':>11}")
    for name, seconds in rows.items():
        print(f"{name:<50} {seconds:>7.2f} {seconds / baseline:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
