"""DPO (every ZeRO stage, a weighted list of losses with a step token mean), KTO, reward models, GRPO, causal,
LoRA and FP8 runs with two CPU processes, in one torchrun launch: each method's one-process run with the same
global batch gives the same weights and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.testing.data import text_rows, write_jsonl
from tests.grpo_helpers import DIGITS, grpo_config, write_prompts
from tests.integration.helpers import merge, train
from tests.launch_helpers import train_in_two_processes

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def test_dpo_grpo_causal_lora_with_two_processes(base_config: dict, tmp_path: Path) -> None:
    pairs = {"name_or_path": str(ROOT / "examples" / "data" / "prefs-train.jsonl"), "sample_count": 32}
    dpo = merge(
        base_config,
        type="dpo",
        data={"sources": [pairs], "max_length": 64},
        train_iters=1,
        loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, 0.5],
        sft_loss_ratio=0.1,
        # scale-sensitive Adam step, no clipping: see test_two_processes.py
        optimizer={"lr": 0.5, "eps": 1.0, "weight_decay": 0.0},
        deepspeed={"gradient_clipping": 0.0},
    )

    def with_out(config: dict, name: str, **changes) -> dict:
        out = {"output_dir": str(tmp_path / name / "export"), "save_end_of_training": True}
        return merge(config, logger={"output_dir": str(tmp_path / name)}, checkpoint=[out], **changes)

    train(with_out(dpo, "dpo-one", micro_batch_size=4))
    text = write_jsonl(tmp_path / "text.jsonl", text_rows(64))
    configs = {f"dpo-z{stage}": with_out(dpo, f"dpo-z{stage}", micro_batch_size=2) for stage in (0, 1, 2, 3)}
    for stage in (0, 1, 2, 3):
        configs[f"dpo-z{stage}"]["deepspeed"]["zero_optimization"] = {"stage": stage}
    configs["causal"] = with_out(
        base_config, "causal", type="causal", data={"sources": [str(text)]}, train_iters=4, micro_batch_size=2
    )
    configs["lora"] = with_out(
        base_config,
        "lora",
        model={"peft_config": {"r": 4, "target_modules": "all-linear"}},
        train_iters=4,
        micro_batch_size=2,
    )
    # grpo: the same global batch of completions on one process (accumulation 2) and on two (1 each)
    (tmp_path / "digits.py").write_text(DIGITS)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 32)
    grpo = grpo_config(base_config, {"train": prompts, "reward": tmp_path / "digits.py"})
    grpo = merge(grpo, train_iters=4, micro_batch_size=8, completions_log_interval=1, beta=0.02)
    train(merge(grpo, logger={"output_dir": str(tmp_path / "grpo-one")}, gradient_accumulation_steps=2))
    configs["grpo"] = merge(
        grpo, logger={"output_dir": str(tmp_path / "grpo-two")}, gradient_accumulation_steps=1
    )
    # kto (the KL baseline all-reduced over the step) and reward models: micro-batch 4 on one process, 2 each
    kto = merge(dpo, type="kto", train_iters=2)
    for key in ("loss_type", "loss_weights", "sft_loss_ratio"):
        kto.pop(key)
    reward = merge(kto, type="reward", train_iters=2)
    for name, config in (("kto", kto), ("reward", reward)):
        train(with_out(config, f"{name}-one", micro_batch_size=4))
        configs[f"{name}-two"] = with_out(config, f"{name}-two", micro_batch_size=2)
    # fp8 (torchao's emulation here): a micro-batch of one row, so each rank casts with the scales the one
    # process computes for that row (tensorwise scales are per micro-batch); ZeRO 2 across the two
    fp8 = merge(
        base_config,
        model={"fp8": "tensorwise"},
        train_iters=3,
        micro_batch_size=1,
        deepspeed={"zero_optimization": {"stage": 2}},
    )
    train(with_out(fp8, "fp8-one", gradient_accumulation_steps=2))
    configs["fp8-two"] = with_out(fp8, "fp8-two", gradient_accumulation_steps=1)
    train_in_two_processes(configs, tmp_path)
    _same_completions_and_rewards(tmp_path / "grpo-one", tmp_path / "grpo-two")
    for name, keys in (
        ("kto", ("loss", "kl", "rewards/chosen")),
        ("reward", ("loss", "accuracy", "margin")),
        ("fp8", ("loss",)),
    ):
        _same_run(tmp_path / f"{name}-one", tmp_path / f"{name}-two", keys)

    expected = load_file(tmp_path / "dpo-one" / "export" / "final" / "model.safetensors")
    one = json.loads((tmp_path / "dpo-one" / "train-log-metrics.jsonl").read_text())
    for stage in (0, 1, 2, 3):
        got = load_file(tmp_path / f"dpo-z{stage}" / "export" / "final" / "model.safetensors")
        assert max(float((expected[k] - got[k]).abs().max()) for k in expected) < 1e-5, stage
        line = json.loads((tmp_path / f"dpo-z{stage}" / "train-log-metrics.jsonl").read_text())
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert abs(line[key] - one[key]) < 1e-5, (stage, key)
    assert (tmp_path / "lora" / "export" / "final" / "adapter_model.safetensors").is_file()
    for name in ("causal", "lora"):
        lines = (tmp_path / name / "train-log-metrics.jsonl").read_text().splitlines()
        assert len(lines) == 4 and all(json.loads(line)["loss"] > 0 for line in lines)


def _same_run(one: Path, two: Path, keys: tuple[str, ...]) -> None:
    expected = load_file(one / "export" / "final" / "model.safetensors")
    got = load_file(two / "export" / "final" / "model.safetensors")
    assert max(float((expected[k] - got[k]).abs().max()) for k in expected) < 1e-5, one.name
    for a, b in zip(*(_records(path) for path in (one, two)), strict=True):
        for key in keys:
            assert abs(a[key] - b[key]) < 1e-5, (one.name, key, a[key], b[key])


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "train-log-metrics.jsonl").read_text().splitlines()]


def _same_completions_and_rewards(one: Path, two: Path) -> None:
    """Every step's rewards (of the whole batch) equal and its loss within 1e-5; rank 0 of two processes
    logged the first half of each batch's completions, the same text as the one process's."""
    records = {
        name: [json.loads(x) for x in (path / "train-log-metrics.jsonl").read_text().splitlines()]
        for name, path in (("one", one), ("two", two))
    }
    assert len(records["one"]) == len(records["two"]) == 4
    for a, b in zip(records["one"], records["two"], strict=True):
        assert a["reward"] == b["reward"] and a["rewards/digit_share/mean"] == b["rewards/digit_share/mean"]
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["kl"] - b["kl"]) < 1e-5
    logged = {
        name: [json.loads(x) for x in (path / "completions.jsonl").read_text().splitlines()]
        for name, path in (("one", one), ("two", two))
    }
    assert len(logged["one"]) == 4 * 16 and len(logged["two"]) == 4 * 8
    for generation in range(4):
        mine = [r for r in logged["one"] if r["generation"] == generation][:8]
        theirs = [r for r in logged["two"] if r["generation"] == generation]
        assert [r["completion"] for r in mine] == [r["completion"] for r in theirs], generation
        assert [r["reward"] for r in mine] == [r["reward"] for r in theirs], generation
