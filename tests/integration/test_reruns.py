"""A run in a folder an earlier run used: its records are its own (the earlier ones moved aside, said), and a
setting the run does not honour (``epochs`` under a smaller ``train_iters``) is said in one line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from posttrain.testing.env import child_env
from tests.integration.helpers import train

pytestmark = pytest.mark.integration


def test_a_new_run_in_a_used_folder_keeps_its_records_apart(
    base_config: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**base_config, "train_iters": 3, "epochs": 2}
    train(config)
    said = capsys.readouterr()
    assert (
        "epochs=2 is not honoured: train_iters=3 ends the run after 3 of their 32 steps"
        in said.out + said.err
    )
    metrics = Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"
    first = metrics.read_text()
    train({**base_config, "train_iters": 2})
    said = capsys.readouterr()
    steps = [json.loads(line)["iter"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2]  # the second run's own, not appended to the first's
    [aside] = (metrics.parent / "earlier-runs").iterdir()
    assert (aside / "train-log-metrics.jsonl").read_text() == first  # moved, not lost
    assert f"held an earlier run's records (train-log-metrics.jsonl): moved to {aside}" in said.out + said.err


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler of its own for SIGTERM (``SigCgt`` in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_a_stop_during_set_up_ends_the_command_with_one_line(base_config: dict, tmp_path: Path) -> None:
    """SIGTERM as soon as ``train`` catches it (before the model has loaded): one line, nothing saved."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**base_config, "train_iters": 50}))
    command = [sys.executable, "-m", "posttrain", "train", str(path)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
    )
    deadline = time.monotonic() + 60
    while not _catches_sigterm(process.pid) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    out = process.communicate(timeout=120)[0]
    assert process.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "stopped by SIGTERM during set-up, before the first step: nothing trained, nothing saved" in out
    assert not (Path(base_config["logger"]["output_dir"]) / "train-log-metrics.jsonl").exists()
