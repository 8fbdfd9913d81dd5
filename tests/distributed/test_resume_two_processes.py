"""Exact resume with two CPU processes (gloo): killed with SIGKILL, restarted with auto_resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import merge
from tests.resume_helpers import (
    assert_same_continuation,
    interrupt_after_three_steps,
    kill_and_resume,
    stop_then_resume_exactly,
)

pytestmark = pytest.mark.distributed


# ZeRO 2 with packing is resumed with sequence parallelism in test_sequence_parallel.py
@pytest.mark.slow  # make test-slow (CI runs it)
@pytest.mark.parametrize(("stage", "pack", "kill_at", "total"), [(3, False, 10, 20)], ids=["zero3"])
def test_sigkill_then_resume_two_processes(
    base_config: dict, tmp_path: Path, stage: int, pack: bool, kill_at: int, total: int
) -> None:
    base = merge(base_config, epochs=3, micro_batch_size=2, deepspeed={"zero_optimization": {"stage": stage}})
    if pack:
        base = merge(base, micro_batch_size=1, data={"pack_samples": True, "max_length": 128})
    results = kill_and_resume(base, tmp_path, nproc=2, kill_at=kill_at, total=total)
    assert_same_continuation(results, kill_at, total)


def test_sigterm_to_the_launcher_stops_both_ranks_and_saves(base_config: dict, tmp_path: Path) -> None:
    import signal

    interrupt_after_three_steps(base_config, tmp_path, signal.SIGTERM, nproc=2)
    assert not (Path(base_config["logger"]["output_dir"]) / "kill-switch").exists()  # the relay cleaned up


@pytest.mark.parametrize(
    "to", ["group", pytest.param("every", marks=pytest.mark.slow)]
)  # every: make test-slow
def test_a_group_or_slurm_signal_to_two_processes_with_workers_saves_and_resumes(
    base_config: dict, tmp_path: Path, to: str
) -> None:
    """SIGTERM to the command's group (``timeout``) or to every process of the job, launcher, ranks and
    DataLoader workers (SLURM at preemption): both ranks end the same step, save, and continue exactly."""
    import signal

    stop_then_resume_exactly(base_config, tmp_path, signal.SIGTERM, nproc=2, to=to, workers=2)
