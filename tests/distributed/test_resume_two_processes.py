"""Exact resume with two CPU processes (gloo): killed with SIGKILL, restarted with auto_resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import merge
from tests.resume_helpers import assert_same_continuation, kill_and_resume

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("stage", "pack", "kill_at", "total"),
    [(2, True, 4, 9), (3, False, 10, 20)],
    ids=["zero2-packed", "zero3"],
)
def test_sigkill_then_resume_two_processes(
    base_config: dict, tmp_path: Path, stage: int, pack: bool, kill_at: int, total: int
) -> None:
    base = merge(base_config, epochs=3, micro_batch_size=2, deepspeed={"zero_optimization": {"stage": stage}})
    if pack:
        base = merge(base, micro_batch_size=1, data={"pack_samples": True, "max_length": 128})
    results = kill_and_resume(base, tmp_path, nproc=2, kill_at=kill_at, total=total)
    assert_same_continuation(results, kill_at, total)


def test_sigterm_to_the_launcher_stops_both_ranks_and_saves(base_config: dict, tmp_path: Path) -> None:
    import json
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from posttrain.testing.env import child_env

    ckpt = tmp_path / "ckpt"
    config = merge(base_config, epochs=1000, micro_batch_size=1)
    config["checkpoint"] = [{"type": "deepspeed", "output_dir": str(ckpt)}]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    metrics = Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"
    command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", "2"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
    )
    deadline = time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=180)
    assert process.returncode == 0, out[-3000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["iter"]
    assert "SIGTERM received" in out and f"stopped early at step {last}" in out
    assert (ckpt / f"global_step_{last}" / "posttrain_state.json").is_file()
    assert not (Path(config["logger"]["output_dir"]) / "kill-switch").exists()
