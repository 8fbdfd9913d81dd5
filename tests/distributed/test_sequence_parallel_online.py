"""Sequence parallelism for the online methods with two CPU processes: each process generates its share of
the group's completions on whole sequences, the group exchanges them, and each micro-batch is split over the
two; the losses of two steps and the first step's gradients (LM head included) equal one process's without
the split, for GRPO with a per-completion loss (``grpo``) and a per-token one (``dapo``), the old policy's and
a reference's log-probabilities computed on the slices (two updates a batch, ``beta`` > 0), and for on-policy
distillation, whose teacher (another width and head count) is split the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.test_sequence_parallel import run_cases
from tests.grpo_helpers import DIGITS, distill_config, grpo_config, write_prompts
from tests.integration.helpers import merge

pytestmark = pytest.mark.distributed


def digit_prompts(root: Path) -> dict[str, Path]:
    (root / "digits.py").write_text(DIGITS)
    return {"train": write_prompts(root / "train.jsonl", 32), "reward": root / "digits.py"}


@pytest.mark.slow  # make test-slow (CI runs it): two launches, about a minute
def test_grpo_sp2_matches_one_process(base_config: dict, tmp_path: Path) -> None:
    files = digit_prompts(tmp_path)
    base = grpo_config(
        base_config,
        files,
        train_iters=2,
        num_iterations=2,
        beta=0.1,
        num_generations=4,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        optimizer={"lr": 1e-3},
        deepspeed={"gradient_clipping": 0.0},
    )
    distill = distill_config(
        tmp_path,
        files["train"],
        micro_batch_size=4,
        train_iters=2,
        optimizer={"lr": 1e-3},
        checkpoint=[],
        deepspeed={"gradient_clipping": 0.0},
    )
    cases: dict[str, dict[str, Any]] = {
        "grpo": merge(base, loss_type="grpo"),
        "dapo": merge(base, loss_type="dapo", deepspeed={"zero_optimization": {"stage": 2}}),
        "distill": distill,  # the teacher (its own heads) split over the group too
    }
    one = run_cases(
        {name: merge(c, logger={"output_dir": str(tmp_path / f"one-{name}")}) for name, c in cases.items()},
        tmp_path,
        nproc=1,
    )
    split = run_cases(
        {
            name: merge(c, sequence_parallel_size=2, logger={"output_dir": str(tmp_path / f"sp-{name}")})
            for name, c in cases.items()
        },
        tmp_path,
        nproc=2,
    )
    for name, want in one.items():
        got = split[name]
        assert got["sp_attention_calls"] > 0 and not want["sp_attention_calls"], name
        assert len(got["losses"]) == len(want["losses"]) == 2, name
        for a, b in zip(got["losses"], want["losses"], strict=True):
            assert abs(a - b) <= 1e-6, (name, got["losses"], want["losses"])
        assert "lm_head.weight" in got["grads"]
        worst = max(float((got["grads"][k] - want["grads"][k]).abs().max()) for k in want["grads"])
        assert worst <= 1e-6, (name, worst)


@pytest.mark.slow  # make test-slow (CI runs it)
def test_grpo_sp2_killed_between_two_updates_resumes_exactly(base_config: dict, tmp_path: Path) -> None:
    """Killed after step 3 of 6 with two updates a batch: the kept micro-batches (this rank's slices) come
    back from the checkpoint and the run ends on the uninterrupted run's losses and weights."""
    from tests.resume_helpers import assert_same_continuation, kill_and_resume

    base = grpo_config(
        base_config,
        digit_prompts(tmp_path),
        num_iterations=2,
        num_generations=4,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        sequence_parallel_size=2,
    )
    results = kill_and_resume(base, tmp_path, nproc=2, kill_at=3, total=6)
    assert_same_continuation(results, kill_at=3, total=6)
