"""Exact resume on one process: killed with SIGKILL mid-epoch, restarted with auto_resume."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.helpers import merge, metrics, train
from tests.resume_helpers import (
    DYING,
    assert_same_continuation,
    cli,
    interrupt_after_three_steps,
    kill_and_resume,
    stop_then_resume_exactly,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("stage", "pack", "kill_at", "total"),
    [
        (2, False, 10, 20),
        pytest.param(3, True, 5, 12, marks=pytest.mark.slow),
    ],  # ZeRO 3 packed: make test-slow
    ids=["zero2", "zero3-packed"],
)
def test_sigkill_then_resume_matches_uninterrupted(
    base_config: dict, tmp_path: Path, stage: int, pack: bool, kill_at: int, total: int
) -> None:
    base = merge(base_config, epochs=3, deepspeed={"zero_optimization": {"stage": stage}})
    if pack:
        base = merge(base, micro_batch_size=1, data={"pack_samples": True, "max_length": 128})
    results = kill_and_resume(base, tmp_path, nproc=1, kill_at=kill_at, total=total)
    assert_same_continuation(results, kill_at, total)


def test_kill_during_save_keeps_previous_checkpoint(base_config: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    config = merge(base_config, train_iters=10, code=str(DYING), skip_validation=True)
    config["checkpoint"] = [{"type": "deepspeed-dies", "output_dir": str(ckpt), "save_every_n_steps": 3,
                             "die_at_step": 6, "die_during_save": True}]  # fmt: skip
    done = cli(config, tmp_path / "dies.yaml")
    assert done.returncode == -signal.SIGKILL
    assert (ckpt / ".staging" / "global_step_6").is_dir()  # the half-written one
    assert sorted(p.name for p in ckpt.iterdir()) == [".staging", "global_step_3", "latest"]
    assert (ckpt / "latest").read_text() == "global_step_3"
    config = merge(config, skip_validation=False)
    del config["code"]
    config["checkpoint"] = [{"type": "deepspeed", "output_dir": str(ckpt), "auto_resume": True, "save_total_limit": 2,
                             "save_every_n_steps": 3}]  # fmt: skip
    done = cli(config, tmp_path / "resume.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "global_step_3 (step 3" in done.stdout
    # saves at 6 and 9 after the resume; save_total_limit: 2 removed global_step_3
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "global_step_6",
        "global_step_9",
        "latest",
    ]
    assert not any((ckpt / ".staging").iterdir())  # the half-written step 6 was cleared before rewriting it


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_step_saves_and_exits_0(
    base_config: dict, tmp_path: Path, sig: signal.Signals
) -> None:
    interrupt_after_three_steps(base_config, tmp_path, sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_to_the_whole_group_with_dataloader_workers_saves_and_resumes_exactly(
    base_config: dict, tmp_path: Path, sig: signal.Signals
) -> None:
    """What ``timeout`` and Ctrl-C do: the signal reaches the DataLoader's workers too; the run still ends
    its step in one line, saves, and continues exactly."""
    stop_then_resume_exactly(base_config, tmp_path, sig, nproc=1, to="group", workers=2)


def test_time_limit_stops_and_saves(base_config: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    config = merge(base_config, epochs=1000, exit_duration_in_mins=0.05)  # 3 seconds
    config["checkpoint"] = [{"type": "deepspeed", "output_dir": str(ckpt)}]
    done = cli(config, tmp_path / "run.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exit_duration_in_mins=0.05 reached" in done.stdout
    assert len([p for p in ckpt.iterdir() if p.name.startswith("global_step_")]) == 1


def test_a_resumed_run_follows_the_configs_learning_rate(base_config: dict, tmp_path: Path, capsys) -> None:
    """The checkpoint gives the step, the config the schedule: a learning rate changed on resume is the
    one the next steps run at, and the run says so."""
    checkpoint = {"type": "deepspeed", "output_dir": str(tmp_path / "ckpt"), "save_every_n_steps": 2}
    first = merge(base_config, train_iters=2, optimizer={"lr": 1e-2}, checkpoint=[checkpoint])
    train(first)
    resumed = merge(
        first, train_iters=4, optimizer={"lr": 0.0}, checkpoint=[{**checkpoint, "auto_resume": True}]
    )
    train(resumed)
    records = {r["iter"]: r for r in metrics(resumed)}
    assert records[2]["lr"] == pytest.approx(1e-2) and records[3]["lr"] == 0.0 and records[4]["lr"] == 0.0
    assert "the config's learning rate (0) differs from the checkpoint's (0.01)" in capsys.readouterr().out
