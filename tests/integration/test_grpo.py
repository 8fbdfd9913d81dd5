"""Online RL (``type: grpo``) on the tiny model: it learns from a reward, logs what a TRL user looks for,
evaluates held-out prompts, resumes exactly after SIGKILL (also between two updates of one generated batch),
and stops with a clear line on bad rewards and bad batch sizes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from posttrain.errors import UserError
from tests.grpo_helpers import DIGITS, grpo_config, write_prompts
from tests.integration.helpers import metrics, train
from tests.resume_helpers import assert_same_continuation, cli, kill_and_resume

pytestmark = pytest.mark.integration


#: a reward of weight 0 that reads TRL's trainer_state and logs through log_metric and log_extra
PROGRESS = """
def progress(completions, trainer_state, log_metric, log_extra, **kwargs):
    log_metric("progress/share_done", trainer_state.global_step / trainer_state.max_steps)
    log_extra("step_seen", [trainer_state.global_step] * len(completions))
    return [0.0] * len(completions)
"""


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grpo")
    (root / "digits.py").write_text(DIGITS)
    return {
        "train": write_prompts(root / "train.jsonl", 64),
        "eval": write_prompts(root / "eval.jsonl", 8, seed=1),
        "reward": root / "digits.py",
    }


def test_grpo_learns_from_a_reward_and_logs_what_trl_users_look_for(
    base_config: dict, prompt_files: dict[str, Path], tmp_path: Path
) -> None:
    progress = tmp_path / "progress.py"
    progress.write_text(PROGRESS)
    config = grpo_config(
        base_config,
        prompt_files,
        train_iters=24,
        beta=0.02,
        data={"eval_sources": [str(prompt_files["eval"])]},
        eval_on_start=True,
        completions_log_interval=4,
    )
    config["rewards"].append({"function": f"{progress}:progress", "weight": 0.0})
    train(config)
    records = metrics(config)
    steps = [r for r in records if "reward" in r]
    assert len(steps) == 24
    first, last = (sum(r["reward"] for r in part) / len(part) for part in (steps[:4], steps[-4:]))
    assert last > 4 * first and last > 0.02, (first, last)  # the digit share grows
    for key in (
        "reward",
        "reward_std",
        "reward_std_group",
        "rewards/digit_share/mean",
        "rewards/digit_share/std",
        "rewards/exact_match/mean",
        "completions/mean_length",
        "completions/mean_terminated_length",
        "completions/min_terminated_length",
        "completions/max_terminated_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "num_tokens",
        "generation_share",
        "time_generation",
        "progress/share_done",
    ):
        assert all(key in r for r in steps), key
    # TRL's num_tokens: prompt and completion tokens of every batch so far (32 completions a batch here)
    for before, after in itertools.pairwise(steps):
        grown = after["num_tokens"] - before["num_tokens"]
        assert grown > 32 * after["completions/mean_length"] - 1e-6, (before["iter"], grown)
    # TRL's trainer_state, log_metric and log_extra: the share of the run done when each batch was generated
    assert [r["progress/share_done"] for r in steps[:3]] == pytest.approx([0 / 24, 1 / 24, 2 / 24])
    assert 0 < steps[0]["generation_share"] < 1 and steps[-1]["kl"] > 0 and steps[0]["entropy"] > 0
    evaluations = [r for r in records if "eval_reward" in r]
    assert [r["iter"] for r in evaluations] == [0, 24]  # eval_on_start and at the end: greedy completions
    assert all(r["eval_loss"] == pytest.approx(-r["eval_reward"]) for r in evaluations)
    logged = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert {r["generation"] for r in logged} == {0, 4, 8, 12, 16, 20} and len(logged) == 6 * 32
    assert set(logged[0]) >= {"prompt", "completion", "reward", "rewards", "advantage", "origin", "step_seen"}
    assert {r["step_seen"] for r in logged if r["generation"] == 4} == {4}
    assert logged[0]["origin"].startswith(str(prompt_files["train"])) and " row " in logged[0]["origin"]
    from posttrain.tracking.plot import plot_metrics

    plot_metrics([tmp_path / "run" / "train-log-metrics.jsonl"], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_sigkill_and_auto_resume_give_the_uninterrupted_rewards_and_losses(
    base_config: dict, prompt_files: dict[str, Path], tmp_path: Path
) -> None:
    """Two updates per generated batch, killed between them (after step 3): the batch is resumed from the
    checkpoint, not generated again by changed weights; the batches after it are generated as before."""
    base = grpo_config(base_config, prompt_files, num_iterations=2, micro_batch_size=8)
    kill_at, total = 3, 6
    results = kill_and_resume(base, tmp_path, nproc=1, kill_at=kill_at, total=total)
    assert_same_continuation(results, kill_at, total)
    reference, resumed = results["reference_metrics"], results["resumed_metrics"]
    for step in range(kill_at + 1, total + 1):
        assert reference[step]["reward"] == resumed[step]["reward"], step  # the same completions
        assert reference[step]["num_tokens"] == resumed[step]["num_tokens"], step  # the run-long count kept


def test_bad_rewards_and_batches_stop_with_one_clear_line(
    base_config: dict, prompt_files: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(completions, **kwargs):\n    return [1 / 0 for _ in completions]\n")
    config = grpo_config(base_config, prompt_files, train_iters=2, rewards=[f"{broken}:reward"])
    done = cli(config, tmp_path / "raises.yaml")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"reward 'reward' ({broken}:1) raised ZeroDivisionError" in done.stderr
    assert f"{prompt_files['train']} row" in done.stderr  # the prompt's row
    cases = {
        "column": ({"rewards": [{"type": "exact_match", "column": "solution"}]}, "no column 'solution'"),
        "batch": (
            {"micro_batch_size": 6, "gradient_accumulation_steps": 1},
            "not a multiple of num_generations=8",
        ),
    }
    for name, (changes, expected) in cases.items():
        config = grpo_config(
            base_config, prompt_files, train_iters=2, logger={"output_dir": str(tmp_path / name)}
        )
        config.update(changes)
        with pytest.raises(UserError, match=expected):
            train(config)
