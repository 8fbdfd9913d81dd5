"""Issue #26: a checkpoint written on N processes continues exactly on M (SIGKILL mid-epoch, 2 -> 1 -> 2)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.integration.helpers import merge, train
from tests.resume_helpers import cli, last_metrics, resume_chain

pytestmark = pytest.mark.distributed


def fixed_batch(base_config: dict, stage: int) -> dict:
    """8 samples per step on any process count (micro-batch 2; accumulation 4 on one process, 2 on two)."""
    config = merge(
        base_config,
        epochs=2,
        total_train_batch_size=8,
        max_per_device_train_batch_size=2,
        optimizer={"lr": 3e-3, "weight_decay": 0.1},
        scheduler={"name": "cosine", "warmup_ratio": 0.2},
        deepspeed={"zero_optimization": {"stage": stage}},
    )
    del config["micro_batch_size"]
    return config


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])  # ZeRO 3: make test-slow
def test_killed_on_two_resumed_on_one_then_on_two(base_config: dict, tmp_path: Path, stage: int) -> None:
    config = fixed_batch(base_config, stage)
    reference = train(merge(config, logger={"output_dir": str(tmp_path / "reference")}))
    expected = {r["iter"]: r for r in reference.state.history if "loss" in r}
    assert len(expected) == 16  # 62 samples: 8 steps per epoch, 2 epochs
    # killed on 2 processes after the checkpoint of step 3 (mid-epoch), resumed on 1 and killed after step 9
    # (one step into the second epoch), resumed on 2 to the end
    legs = resume_chain(config, tmp_path, [(2, 3), (1, 9), (2, None)])
    for step in (3, 9):  # both converted once into DeepSpeed's universal format, kept beside the checkpoint
        assert (tmp_path / "chain" / "ckpt" / f"global_step_{step}" / "universal" / "zero").is_dir()
    assert "this run uses stage" in legs[1].stdout or stage == 3  # ZeRO 2 kept on one process
    assert "written by 2 process(es), resumed on 1" in legs[1].stdout
    assert "written by 1 process(es), resumed on 2" in legs[2].stdout
    got = last_metrics(tmp_path / "chain")
    assert sorted(k for k in got if "loss" in got[k]) == list(range(1, 17))
    for step in range(1, 17):
        assert got[step]["tokens"] == expected[step]["tokens"], step  # the same samples at every step
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-5), step
        assert got[step]["lr"] == pytest.approx(expected[step]["lr"], abs=1e-12), step


@pytest.mark.slow  # make test-slow (CI runs it)
def test_a_global_batch_that_cannot_be_kept_is_refused_or_accepted(base_config: dict, tmp_path: Path) -> None:
    config = merge(base_config, micro_batch_size=2)  # 4 samples per step on 2 processes, 2 on 1
    resume_chain(config, tmp_path, [(2, 3)])
    leg = copy.deepcopy(config)
    leg["logger"] = {"output_dir": str(tmp_path / "chain")}
    resumable = {"type": "deepspeed", "output_dir": str(tmp_path / "chain" / "ckpt"), "auto_resume": True}
    leg["checkpoint"] = [resumable]
    refused = cli(leg, tmp_path / "one.yaml", 1)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "the global batch would change from 4 to 2 samples per step" in refused.stderr
    assert "total_train_batch_size: 4" in refused.stderr and "Traceback" not in refused.stderr
    resumable["accept_batch_change"] = True
    accepted = cli(leg, tmp_path / "one.yaml", 1)
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    assert "accepted (accept_batch_change)" in accepted.stdout
    # 3 steps of 4 samples = 12 samples = 6 steps of 2: the epoch (31 steps of 2) continues at its 7th step
    steps = sorted(last_metrics(tmp_path / "chain"))
    assert steps[-1] == 3 + (31 - 6), steps[-5:]


@pytest.mark.slow  # make test-slow (CI runs it)
def test_bf16_zero2_on_two_resumed_on_one_runs_bf16_optimizer(base_config: dict, tmp_path: Path) -> None:
    """bfloat16: ZeRO 2 on two processes, killed after step 3, resumed on one process, where bf16 runs as
    DeepSpeed's BF16_Optimizer (stage 1): its float32 master weights and Adam moments come from DeepSpeed's
    universal checkpoint; the continuation follows the uninterrupted two-process run (to bf16 rounding: the
    two accumulate gradients in different precisions)."""
    config = merge(fixed_batch(base_config, 2), model={"dtype": "bfloat16"})
    reference = cli(
        merge(config, logger={"output_dir": str(tmp_path / "reference")}), tmp_path / "two.yaml", 2
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = last_metrics(tmp_path / "reference")
    legs = resume_chain(config, tmp_path, [(2, 3), (1, None)])
    assert "written by 2 process(es), resumed on 1" in legs[1].stdout
    assert "runs as DeepSpeed's BF16_Optimizer" in legs[1].stdout, legs[1].stdout[-3000:]
    got = last_metrics(tmp_path / "chain")
    assert sorted(got) == sorted(expected) == list(range(1, 17))
    for step in range(1, 17):
        assert got[step]["tokens"] == expected[step]["tokens"], step
        assert got[step]["lr"] == pytest.approx(expected[step]["lr"], abs=1e-12), step
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=3e-3), step
