"""Expert parallelism with two CPU processes: the grouped implementation equals the Hugging Face experts
module it replaces (outputs, gradients, weights in and out) for every family; EP=2 gives the loss, eval loss and gradients of the unsharded
Hugging Face module under ZeRO 0, 1 and 2 with gradient accumulation; its huggingface export is the model's
own layout with the same weights and logits; LoRA on attention and router next to sharded frozen experts
gives the unsharded run's gradients; a killed EP=2 run resumes exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from posttrain.dist import free_port
from posttrain.testing.env import child_env
from tests.integration.helpers import merge
from tests.resume_helpers import assert_same_continuation, kill_and_resume

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parents[1] / "resources" / "first_step_grads.py"
PARITY = Path(__file__).parents[1] / "resources" / "expert_parity.py"
FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")


@pytest.fixture
def moe_config(base_config: dict, tiny_moe_dirs: dict[str, Path]) -> dict[str, Any]:
    return merge(
        base_config,
        model={"name_or_path": str(tiny_moe_dirs["qwen3_moe"])},
        micro_batch_size=2,
        gradient_accumulation_steps=2,
    )


def run_worker(configs: dict[str, dict[str, Any]], tmp: Path) -> dict[str, Any]:
    specs = []
    for name, config in configs.items():
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        specs.append(f"{name}={path}")
    out = tmp / "results.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += [f"--master_port={free_port()}", str(WORKER), str(out), *specs]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out)


def test_grouped_implementation_equals_the_module_it_replaces_for_every_family() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += [f"--master_port={free_port()}", str(PARITY), *FAMILIES]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["arch"] for r in reports] == list(FAMILIES)
    for report in reports:
        assert report["output_diff"] <= 2e-7 and report["grad_diff"] <= 1e-8, report
        assert report["sharded_weights"] >= 4 and report["same_weights"] and report["shards_restored"], report


def test_ep2_matches_the_unsharded_module_under_zero_0_1_2(moe_config: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    common = merge(
        moe_config,
        train_iters=2,
        eval_at_end=True,
        optimizer={"lr": 0.0},  # the eval loss then compares the forward pass at the same weights
        data={"train_eval_split": [0.8, 0.2]},
    )

    def case(name: str, **changes: Any) -> dict[str, Any]:
        export = {"type": "huggingface", "output_dir": str(tmp_path / name), "save_end_of_training": True}
        return merge(
            common, logger={"output_dir": str(tmp_path / f"run-{name}")}, checkpoint=[export], **changes
        )

    configs = {"plain": case("plain", deepspeed={"zero_optimization": {"stage": 0}})}
    for stage in (0, 1, 2):
        configs[f"ep2-zero{stage}"] = case(
            f"ep2-zero{stage}", expert_parallel_size=2, deepspeed={"zero_optimization": {"stage": stage}}
        )
    configs["grouped-ep1"] = case(
        "grouped-ep1", arctic_moe=True, deepspeed={"zero_optimization": {"stage": 2}}
    )
    # LoRA on attention and router, the experts frozen (DeepSpeed then has no expert gradients to reduce)
    lora = {"peft_config": {"r": 4, "target_modules": ["q_proj", "v_proj", "gate"]}}
    zero2 = {"zero_optimization": {"stage": 2}}
    configs["plain-lora"] = case("plain-lora", model=lora, deepspeed=zero2)
    configs["ep2-lora"] = case("ep2-lora", model=lora, expert_parallel_size=2, deepspeed=zero2)
    results = run_worker(configs, tmp_path)
    references = {"plain": results.pop("plain"), "lora": results.pop("plain-lora")}
    assert references["plain"]["sharded_expert_calls"] == references["lora"]["sharded_expert_calls"] == 0
    assert any("experts." in k for k in references["plain"]["grads"])
    assert any("mlp.gate." in k for k in references["plain"]["grads"])
    assert any("mlp.gate.lora_B" in k for k in references["lora"]["grads"])
    for key, got in results.items():
        want = references["lora" if "lora" in key else "plain"]
        assert got["sharded_expert_calls"] > 0, key
        assert abs(got["loss"] - want["loss"]) <= 1e-5, (key, got["loss"], want["loss"])
        assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-5, (key, got["eval_loss"], want["eval_loss"])
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            assert got["grads"][name].shape == want["grads"][name].shape, name  # experts gathered whole
        worst = max(float((got["grads"][k] - want["grads"][k]).abs().max()) for k in want["grads"])
        assert worst <= 1e-6, (key, worst)

    # the export is the model's own layout: from_pretrained loads it unsharded, with the same logits
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain" / "final", dtype=torch.float32)
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "ep2-zero2" / "final", dtype=torch.float32)
    for (name, a), (_, b) in zip(plain.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name  # lr 0: the weights went in and out unchanged
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=tokens).logits, sharded(input_ids=tokens).logits)


@pytest.mark.slow  # make test-slow (CI runs it)
def test_ep2_killed_and_resumed_continues_exactly(moe_config: dict, tmp_path: Path) -> None:
    base = merge(
        moe_config,
        epochs=2,
        expert_parallel_size=2,
        deepspeed={
            "zero_optimization": {"stage": 0}
        },  # the optimizer state of each expert block: DeepSpeed's
    )
    results = kill_and_resume(base, tmp_path, nproc=2, kill_at=3, total=6)
    assert_same_continuation(results, kill_at=3, total=6)
