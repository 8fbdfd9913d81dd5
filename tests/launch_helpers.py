"""Train several configs in the same two CPU processes: one torchrun launch for many short runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from posttrain.dist import free_port
from posttrain.testing.env import child_env

TRAIN_MANY = Path(__file__).parent / "resources" / "train_many.py"


def train_in_two_processes(configs: dict[str, dict[str, Any]], directory: Path) -> None:
    paths = []
    for name, config in configs.items():
        paths.append(directory / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(config))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
    ]
    command += [str(TRAIN_MANY), *map(str, paths)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
