"""The weights the vLLM backend pushes after every update, checked without vLLM: the checkpoint's names with
LoRA merged in, a ``modules_to_save`` module's trained copy under its own name (never its original), and under
ZeRO-3 the same whole weights (gathered before the adapters merge)."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.generation.vllm_engine import named_weights
from posttrain.tiny_model import build_model

pytestmark = pytest.mark.integration


def _adapted() -> torch.nn.Module:
    """LoRA on the attention projections with non-zero B (merging changes the weights) and a trained copy of
    the LM head (``modules_to_save``) that differs from its original."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build_model(256, hidden_size=32, heads=2, seed=0),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def _expected(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a merged export holds: the state the vLLM engine must end up with."""
    merged = copy.deepcopy(model).merge_and_unload()
    return {name: param.detach().clone() for name, param in merged.named_parameters()}


def test_pushed_weights_are_the_merged_checkpoints() -> None:
    model = _adapted()
    expected = _expected(model)
    pushed = {name: tensor.clone() for name, tensor in named_weights(model)}
    assert sorted(pushed) == sorted(expected)  # no lora_*, no original_module, no PEFT prefix
    for name, tensor in expected.items():
        assert torch.equal(pushed[name], tensor), name
    assert not torch.equal(pushed["lm_head.weight"], model.base_model.model.lm_head.original_module.weight)
    after = dict(model.named_parameters())  # the adapters are unmerged again: training goes on unchanged
    base = after["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.equal(base, expected["model.layers.0.self_attn.q_proj.weight"])


def test_zero3_gathers_before_the_adapters_merge() -> None:
    """A ZeRO-3 engine over the adapted model (its parameters partitioned, empty outside a gather): the
    pushed weights are the whole merged ones."""
    import deepspeed

    from posttrain.dist import init_distributed

    init_distributed()
    model = _adapted()
    expected = _expected(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable), config=config)
    assert any(p.numel() == 0 for p in engine.module.parameters())  # partitioned
    pushed = {name: tensor.clone() for name, tensor in named_weights(engine.module)}
    assert sorted(pushed) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.allclose(pushed[name], tensor, atol=1e-6), name
