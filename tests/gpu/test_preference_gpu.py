"""Preference round two on a GPU, in bf16: a weighted DPO loss list with the score offset, KTO (its KL
baseline computed each step on the device) and a reward model, each learning on the bundled data; the
FlashAttention check lets an installed package through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.helpers import merge, metrics, train

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
PAIRS = ROOT / "examples" / "data" / "prefs-train.jsonl"


def test_dpo_loss_list_with_scores_in_bf16(base_config: dict, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in PAIRS.open()][:256]
    scored = tmp_path / "scored.jsonl"
    scored.write_text(
        "".join(json.dumps({**r, "score_chosen": 3.0, "score_rejected": 1.0}) + "\n" for r in rows)
    )
    config = merge(
        base_config,
        type="dpo",
        model={"dtype": "bfloat16"},
        data={"sources": [str(scored)], "max_length": 64},
        loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, 0.2],
        offset_alpha=0.1,
        micro_batch_size=16,
        train_iters=16,
        optimizer={"lr": 5e-3},
    )
    result = train(config)
    assert next(result.model.parameters()).device.type == "cuda"
    steps = [r for r in metrics(config) if "loss" in r]
    assert steps[-1]["rewards/margins"] > steps[0]["rewards/margins"]


def test_kto_and_reward_models_learn_in_bf16(base_config: dict, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in PAIRS.open()][:256]
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "completion": c, "label": good}) + "\n"
            for r in rows
            for c, good in ((r["chosen"], True), ("I cannot reverse numbers.", False))
        )
    )
    kto = merge(
        base_config,
        type="kto",
        model={"dtype": "bfloat16"},
        data={"sources": [str(feedback)], "max_length": 64},
        micro_batch_size=16,
        train_iters=24,
        optimizer={"lr": 2e-3},
        logger={"output_dir": str(tmp_path / "kto")},
    )
    train(kto)
    steps = [r for r in metrics(kto) if "loss" in r]
    assert steps[-1]["rewards/chosen"] - steps[-1]["rewards/rejected"] > 1.0
    reward = merge(
        base_config,
        type="reward",
        model={"dtype": "bfloat16"},
        data={"sources": [str(ROOT / "examples" / "data" / "reward-train.jsonl")], "max_length": 64},
        micro_batch_size=16,
        train_iters=40,
        optimizer={"lr": 3e-4},
        logger={"output_dir": str(tmp_path / "reward")},
    )
    train(reward)
    steps = [r for r in metrics(reward) if "loss" in r]
    assert sum(r["accuracy"] for r in steps[-8:]) / 8 > 0.75


def test_flash_attention_passes_the_check_when_installed() -> None:
    pytest.importorskip("flash_attn")
    from posttrain.models.huggingface import check_attention_kernel

    check_attention_kernel("flash_attention_2")  # a CUDA GPU and the package: no error
