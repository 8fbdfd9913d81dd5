"""DPO on the tiny model: the bundled example learns, the reference stays frozen, every loss type trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.config import load_config
from posttrain.optim.adamw import param_groups
from posttrain.run import run
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def dpo_config(base_config: dict, **changes) -> dict:
    pairs = ROOT / "examples" / "data" / "prefs-train.jsonl"
    return merge(
        base_config,
        type="dpo",
        data={"sources": [{"name_or_path": str(pairs), "sample_count": 64}], "max_length": 64},
        **changes,
    )


def test_bundled_preference_example_learns_the_preferences(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The example's held-out accuracy; 87.5% was measured in bf16 on an H100, so the bar (80%) leaves room
    for bf16 and fp32 alike, far above the 50% of a policy that learned nothing."""
    example = yaml.safe_load((ROOT / "examples" / "dpo-reverse.yaml").read_text())
    example["model"]["name_or_path"] = str(tiny_model_dir)
    example["data"]["sources"] = [str(ROOT / "examples" / "data" / "prefs-train.jsonl")]
    example["data"]["eval_sources"] = [str(ROOT / "examples" / "data" / "prefs-eval.jsonl")]
    example["logger"] = {"output_dir": str(tmp_path / "dpo")}
    example["loss_log_interval"] = 0
    result = run(load_config(data=example))
    history = result.state.history
    assert history[0]["rewards/accuracy"] == pytest.approx(0.5)  # policy = reference: every margin is 0
    evals = [h for h in history if "eval_rewards/accuracy" in h]
    assert evals[-1]["eval_rewards/accuracy"] >= 0.8, [h["eval_rewards/accuracy"] for h in evals]
    assert evals[-1]["eval_rewards/margins"] > 0
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert key in history[-1] and f"eval_{key}" in evals[-1]


def test_reference_is_frozen_and_not_optimised(base_config: dict, tiny_model_dir: Path, capsys) -> None:
    config = dpo_config(
        base_config, train_iters=3, ref_model={"name_or_path": str(tiny_model_dir), "dtype": "float32"}
    )
    result = train(config)
    assert "reference log-probabilities computed once for 64 pairs" in capsys.readouterr().out
    groups = param_groups(result.model, 0.1, 1e-3)
    optimised = sum(p.numel() for group in groups for p in group["params"])
    assert optimised == sum(p.numel() for p in result.model.parameters())  # the policy's, nothing else
    assert result.state.history[0]["rewards/margins"] == pytest.approx(
        0.0, abs=1e-9
    )  # same weights as the ref


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "simpo", "orpo"])
def test_every_loss_type_trains(base_config: dict, loss_type: str) -> None:
    config = dpo_config(
        base_config, epochs=3, loss_type=loss_type, optimizer={"lr": 5e-3}, sft_loss_ratio=0.1
    )
    history = train(config).state.history

    def mean(key: str, epoch: int) -> float:
        values = [h[key] for h in history if h["epoch"] == epoch]
        return sum(values) / len(values)

    assert mean("loss", 2) < mean("loss", 0)
    assert mean("rewards/margins", 2) > mean("rewards/margins", 0)
    if loss_type != "orpo":  # ORPO's NLL term dominates here: chosen and rejected share their tokens
        assert mean("rewards/accuracy", 2) > mean("rewards/accuracy", 0)


def test_reference_free(base_config: dict, capsys) -> None:
    train(dpo_config(base_config, train_iters=1, reference_free=True))
    assert "reference log-probabilities" not in capsys.readouterr().out
