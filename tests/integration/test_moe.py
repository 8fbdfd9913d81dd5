"""Mixture-of-experts models on one process: every supported family trains with sft, dpo and causal, the
router loss is weighted, reported apart and kept out of eval_loss, the expert load is logged, LoRA reaches
the experts and the router (SiloGen's Mixtral targets), and what cannot run is refused with a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from posttrain.errors import UserError
from posttrain.testing.data import text_rows, write_jsonl
from tests.integration.helpers import merge, metrics, train

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def moe(base_config: dict, tiny_moe_dirs: dict[str, Path], arch: str = "qwen3_moe", **changes: Any) -> dict:
    model = {"name_or_path": str(tiny_moe_dirs[arch])}
    if arch == "gpt_oss":
        model["attn_implementation"] = "eager"  # transformers has no sdpa path for its attention sinks
    config = merge(base_config, model=model, train_iters=3, loss_log_interval=1)
    return merge(config, **changes)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_each_family_trains_sft_with_router_loss_and_expert_load(
    base_config: dict, tiny_moe_dirs: dict[str, Path], arch: str
) -> None:
    config = moe(base_config, tiny_moe_dirs, arch, optimizer={"lr": 1e-2}, loss_log_interval=2)
    history = train(config).state.history
    assert history[-1]["loss"] < history[0]["loss"]
    records = metrics(config)
    assert all(r["router_aux_loss"] > 0.9 for r in records)  # >= 1 by construction, 1 when perfectly even
    logged = [r for r in records if "expert_load" in r]
    assert [r["iter"] for r in logged] == [2]  # at the metrics interval
    load = logged[0]["expert_load"]
    assert len(load) == 2 and all(len(row) == 8 and abs(sum(row) - 1) < 1e-3 for row in load)
    imbalance = logged[0]["expert_imbalance"]
    assert (
        imbalance == pytest.approx(max(logged[0]["expert_imbalance_per_layer"]), abs=1e-4) and imbalance >= 1
    )


@pytest.mark.parametrize("method", ["dpo", "causal"])
def test_dpo_and_causal_train_an_moe_model(
    base_config: dict, tiny_moe_dirs: dict[str, Path], tmp_path: Path, method: str
) -> None:
    if method == "dpo":
        data = {
            "sources": [{"name_or_path": str(ROOT / "examples/data/prefs-train.jsonl"), "sample_count": 32}]
        }
    else:
        data = {"sources": [str(write_jsonl(tmp_path / "text.jsonl", text_rows(40)))]}
    config = moe(base_config, tiny_moe_dirs, type=method, data=data)
    records = train(config).state.history
    assert len(records) == 3 and all("router_aux_loss" in r and "expert_load" in r for r in records)


def test_router_loss_weight_moves_the_gradient_but_never_the_reported_losses(
    base_config: dict, tiny_moe_dirs: dict[str, Path], tmp_path: Path
) -> None:
    runs = {}
    for coef in (0.0, 100.0):
        config = moe(
            base_config,
            tiny_moe_dirs,
            train_iters=1,
            optimizer={"lr": 0.0},
            data={"train_eval_split": [0.8, 0.2]},
            eval_at_end=True,
            model={"router_aux_loss_coef": coef},
            logger={"output_dir": str(tmp_path / f"coef-{coef}")},
        )
        runs[coef] = train(config).state.history
    plain, weighted = runs[0.0], runs[100.0]
    assert plain[0]["loss"] == weighted[0]["loss"]  # the NLL alone
    assert plain[0]["router_aux_loss"] == weighted[0]["router_aux_loss"]
    assert plain[-1]["eval_loss"] == weighted[-1]["eval_loss"]  # the router loss is not part of it
    assert weighted[0]["grad_norm"] > plain[0]["grad_norm"] * 1.05  # but it is trained


def test_lora_on_experts_and_router_with_silogens_mixtral_targets(
    base_config: dict, tiny_moe_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # SiloGen's Mixtral profile names the per-expert linears w1/w2/w3 and the router gate; PEFT maps them onto
    # transformers' fused expert weights and the router weight
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3", "gate"]
    export = tmp_path / "out"
    config = moe(
        base_config,
        tiny_moe_dirs,
        "mixtral",
        optimizer={"lr": 1e-2},
        model={"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": targets}},
        checkpoint=[{"output_dir": str(export), "save_end_of_training": True}],
    )
    model = train(config).model.cpu()  # compared with the adapter loaded on the CPU
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    for part in ("mlp.experts.", "mlp.gate.", "self_attn.q_proj."):
        changed = [n for n, p in trainable.items() if part in n and "lora_B" in n and p.abs().sum() > 0]
        assert changed, part  # B starts at zero: trained
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dirs["mixtral"], dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, export / "final").eval()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    model.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


@pytest.mark.parametrize(
    ("model_changes", "changes", "says"),
    [
        ({"router_aux_loss_coef": 0.1}, {}, "is dense"),
        ({}, {"arctic_moe": True}, "is dense"),
        ({"experts_implementation": "eager"}, {}, "is dense"),
    ],
    ids=["router-coef-on-dense", "grouped-on-dense", "experts-kernel-on-dense"],
)
def test_moe_settings_on_a_dense_model_are_refused(
    base_config: dict, model_changes: dict, changes: dict, says: str
) -> None:
    with pytest.raises(UserError, match=says):
        train(merge(base_config, model=model_changes, **changes))


def test_refusals_that_need_the_built_model(base_config: dict, tiny_moe_dirs: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="attn_implementation: eager"):
        train(merge(base_config, model={"name_or_path": str(tiny_moe_dirs["gpt_oss"])}))
    lora = {"r": 4, "target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj"]}
    with pytest.raises(UserError, match="LoRA on the expert weights"):
        train(moe(base_config, tiny_moe_dirs, arctic_moe=True, model={"peft_config": lora}))


def test_tiny_model_command_builds_a_mixture_of_experts(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from posttrain.cli import main

    out = tmp_path / "olmoe"
    assert (
        main(["tiny-model", str(out), "--arch", "olmoe", "--experts", "4", "--top-k", "1", "--layers", "1"])
        == 0
    )
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("olmoe", 4, 1)
