"""Reward models on the tiny model: Bradley-Terry learns the bundled pairs, evaluation logs pairwise accuracy
and margin, the export loads with AutoModelForSequenceClassification and scores as trained, the margin
column and centring enter the loss, LoRA trains the head whole, the generic head covers unmapped
architectures, and grpo scores completions with an export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.cli import main
from posttrain.methods.reward import bradley_terry
from posttrain.models.reward_model import load_sequence_classifier
from tests.integration.helpers import merge, train
from tests.resume_helpers import assert_same_continuation, kill_and_resume

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "data" / "reward-train.jsonl"
EVAL = ROOT / "examples" / "data" / "reward-eval.jsonl"


def reward_config(base_config: dict, tmp_path: Path, name: str, **changes) -> dict:
    export = {
        "type": "huggingface",
        "output_dir": str(tmp_path / name / "export"),
        "save_end_of_training": True,
    }
    config = merge(
        base_config,
        type="reward",
        data={"sources": [{"name_or_path": str(TRAIN), "sample_count": 256}], "max_length": 64},
        optimizer={"lr": 3e-4},
        logger={"output_dir": str(tmp_path / name)},
        checkpoint=[export],
    )
    return merge(config, **changes)


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, chat_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One reward model trained on the bundled pairs, shared by the checks below."""
    from tests.conftest import make_base_config

    tmp = tmp_path_factory.mktemp("reward")
    base = make_base_config(tiny_model_dir, chat_file, tmp)
    config = reward_config(base, tmp, "run", micro_batch_size=8, eval_interval=16)
    config["data"]["eval_sources"] = [{"name_or_path": str(EVAL), "sample_count": 64}]
    result = train(config)
    return {"history": result.state.history, "export": tmp / "run" / "export" / "final"}


def test_bradley_terry_against_the_hand_computation() -> None:
    chosen, rejected = (
        torch.tensor([1.5, -0.2], dtype=torch.float64),
        torch.tensor([0.5, 0.3], dtype=torch.float64),
    )
    margin = torch.tensor([0.25, 0.0], dtype=torch.float64)

    def ls(x: float) -> float:
        return -math.log1p(math.exp(-x))

    expected = [-ls(1.5 - 0.5 - 0.25) + 0.01 * 2.0**2, -ls(-0.2 - 0.3) + 0.01 * 0.1**2]
    got = bradley_terry(chosen, rejected, margin, 0.01).tolist()
    assert got == pytest.approx(expected, rel=1e-12)
    assert bradley_terry(chosen, rejected, margin, None).tolist() == pytest.approx(
        [-ls(0.75), -ls(-0.5)], rel=1e-12
    )


def test_reward_model_learns_and_logs_trl_metrics(trained: dict) -> None:
    evals = [h for h in trained["history"] if "eval_accuracy" in h]
    assert evals[-1]["eval_accuracy"] >= 0.75, [h["eval_accuracy"] for h in evals]
    assert evals[-1]["eval_margin"] > 0.5
    last = trained["history"][-1]
    for key in ("accuracy", "margin", "rewards/chosen", "rewards/rejected"):
        assert key in last


def test_export_loads_as_a_sequence_classifier_and_scores_as_trained(trained: dict) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(trained["export"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained["export"])
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    rows = [json.loads(line) for line in EVAL.open()][:32]
    better = 0
    for row in rows:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row[side]}],
                tokenize=False,
            )
            for side in ("chosen", "rejected")
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            scores = model(**batch).logits[:, 0]
        better += int(scores[0] > scores[1])
    assert better / len(rows) >= 0.75  # the trained ranking, read back through transformers alone


def test_margin_and_centring_enter_the_loss(base_config: dict, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in TRAIN.open()][:16]
    wide = tmp_path / "wide.jsonl"
    wide.write_text("".join(json.dumps({**r, "margin": 5.0}) + "\n" for r in rows))
    plain = train(reward_config(base_config, tmp_path, "plain", train_iters=1, data={"sources": [str(wide)]}))
    # before the first update the head is random and small: a margin of 5 puts the loss near 5
    assert plain.state.history[0]["loss"] > 4.5
    centred = train(
        reward_config(
            base_config,
            tmp_path,
            "centred",
            train_iters=1,
            data={"sources": [str(wide)]},
            center_rewards_coefficient=1.0,
        )
    )
    assert centred.state.history[0]["loss"] > plain.state.history[0]["loss"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "margin": "big"}) + "\n")
    from posttrain.errors import UserError

    with pytest.raises(UserError, match=r"bad.jsonl.*row 1.*'margin' must be a finite number"):
        train(reward_config(base_config, tmp_path, "bad", train_iters=1, data={"sources": [str(bad)]}))


def test_lora_reward_model_trains_the_head_and_merges(base_config: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    config = reward_config(
        base_config, tmp_path, "lora", train_iters=4, micro_batch_size=8, model={"peft_config": {"r": 4}}
    )
    config["checkpoint"][0]["save_merged"] = True
    result = train(config)
    trainable = {n for n, p in result.model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any("score" in n for n in trainable)
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lora" / "export" / "final-merged")
    assert merged.config.num_labels == 1


def test_generic_head_for_an_unmapped_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    from posttrain.models.reward_model import load_sequence_classifier, sequence_scores

    model = load_sequence_classifier(str(tiny_model_dir), generic=True)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.score.out_features == 1
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1] * 4]),
    }
    model.config.pad_token_id = 0
    scores = sequence_scores(model, batch)
    model.save_pretrained(tmp_path / "generic")
    again = load_sequence_classifier(str(tmp_path / "generic"), generic=True)
    again.config.pad_token_id = 0
    assert torch.equal(sequence_scores(again, batch), scores)


def test_grpo_scores_completions_with_a_reward_model(
    base_config: dict, trained: dict, tmp_path: Path, capsys
) -> None:
    from tests.grpo_helpers import grpo_config, write_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    config = grpo_config(base_config, {"train": prompts, "reward": None})
    config = merge(config, train_iters=2, micro_batch_size=8, completions_log_interval=1)
    config["rewards"] = [{"model": str(trained["export"]), "batch_size": 4, "name": "rm"}]
    history = train(config).state.history
    assert all(math.isfinite(h["rewards/rm/mean"]) for h in history if "rewards/rm/mean" in h)
    logged = [
        json.loads(line) for line in (Path(config["logger"]["output_dir"]) / "completions.jsonl").open()
    ]
    assert len({round(r["reward"], 6) for r in logged}) > 1  # scores, not a constant
    # the memory plan holds the reward model whole on every process, in its checkpoint's dtype
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["preprocess", str(path), "--json"]) == 0
    items = json.loads(capsys.readouterr().out)["memory"]["items"]
    held = [item for item in items if item["part"] == "reward model"]
    loaded = load_sequence_classifier(str(trained["export"]))
    assert len(held) == 1 and held[0]["bytes"] == sum(p.numel() for p in loaded.parameters()) * 4
    config["rewards"][0]["model"] = str(tmp_path / "nowhere")
    path.write_text(yaml.safe_dump(config))
    assert main(["preprocess", str(path)]) == 2
    assert "rewards[0].model=" in capsys.readouterr().err


@pytest.mark.slow  # make test-slow (CI runs it)
def test_sigkill_then_resume_is_exact(base_config: dict, tmp_path: Path) -> None:
    base = reward_config(
        base_config, tmp_path, "resume", epochs=3, micro_batch_size=4, gradient_accumulation_steps=2
    )
    results = kill_and_resume(base, tmp_path, nproc=1, kill_at=3, total=6)
    assert_same_continuation(results, 3, 6)
    for step in range(4, 7):
        assert results["reference_metrics"][step]["accuracy"] == results["resumed_metrics"][step]["accuracy"]
