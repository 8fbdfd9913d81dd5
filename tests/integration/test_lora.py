"""LoRA: only the adapter trains; it saves in PEFT's format, reloads exactly, merges, and continues."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from posttrain.optim.adamw import param_groups
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def test_lora_trains_only_the_adapter_and_exports(
    base_config: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = merge(
        base_config,
        epochs=3,
        optimizer={"lr": 5e-2},
        model={"peft_config": LORA},
        checkpoint=[{"output_dir": str(tmp_path / "out"), "save_end_of_training": True, "save_merged": True}],
    )
    result = train(config)
    model = result.model.cpu()  # compared with checkpoints loaded on the CPU
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    lora_params = sum(p.numel() for p in trainable.values())
    # r * (in + out) per linear module: q 64->64, k/v 64->32, o 64->64, gate/up 64->256, down 256->64;
    # two layers; "all-linear" leaves out the LM head
    per_layer = 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 256) + (256 + 64))
    assert lora_params == 2 * per_layer == 22528
    history = result.state.history
    # the base is a random model whose embeddings and head stay frozen, so LoRA only gets so far (~7%)
    assert history[-1]["loss"] < 0.95 * history[0]["loss"]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_state = base.state_dict()
    frozen_now = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): p
        for n, p in model.named_parameters()
        if "lora_" not in n
    }
    assert all(
        torch.equal(frozen_now[n], base_state[n]) for n in base_state if n in frozen_now
    )  # base unchanged

    export = tmp_path / "out" / "final"
    assert (export / "adapter_model.safetensors").is_file() and (export / "adapter_config.json").is_file()
    assert not (export / "model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(base, export).eval()
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert torch.allclose(reloaded(input_ids=ids).logits, expected, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(
            tmp_path / "out" / "final-merged", dtype=torch.float32
        ).eval()
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-4)


def test_optimizer_holds_only_adapter_parameters(base_config: dict) -> None:
    config = merge(base_config, train_iters=1, model={"peft_config": LORA}, optimizer={"lora_plus_scale": 16})
    result = train(config)
    groups = param_groups(result.model, 0.1, 1e-3, 16)
    optimised = [p for group in groups for p in group["params"]]
    assert sum(p.numel() for p in optimised) == sum(
        p.numel() for p in result.model.parameters() if p.requires_grad
    )
    lrs = {
        ("lora_B" in name): group["lr"]
        for group in groups
        for name, p in result.model.named_parameters()
        if any(p is q for q in group["params"])
    }
    assert lrs == {True: pytest.approx(16e-3), False: pytest.approx(1e-3)}


def test_continue_from_a_saved_adapter(base_config: dict, tmp_path: Path) -> None:
    first = merge(
        base_config,
        epochs=3,
        optimizer={"lr": 5e-2},
        model={"peft_config": LORA},
        checkpoint=[{"output_dir": str(tmp_path / "a"), "save_end_of_training": True}],
    )
    history = train(first).state.history
    start_loss, end_loss = history[0]["loss"], history[-1]["loss"]
    second = merge(
        base_config,
        train_iters=1,
        optimizer={"lr": 1e-9},
        model={"peft_pretrained": str(tmp_path / "a" / "final")},
        logger={"output_dir": str(tmp_path / "b")},
    )
    result = train(second)
    resumed_loss = result.state.history[0]["loss"]
    assert abs(resumed_loss - end_loss) < abs(resumed_loss - start_loss)  # starts where the first run ended
    assert any(p.requires_grad for n, p in result.model.named_parameters() if "lora_" in n)


def test_adapter_export_records_an_absolute_base_and_a_model_card(
    base_config: dict, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    import json

    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(tiny_model_dir.parent)  # the base model given by a relative path
    config = merge(
        base_config,
        train_iters=2,
        model={"name_or_path": tiny_model_dir.name, "peft_config": LORA},
        tokenizer={"name_or_path": tiny_model_dir.name},
        checkpoint=[{"output_dir": str(tmp_path / "out"), "save_end_of_training": True}],
    )
    train(config)
    export = tmp_path / "out" / "final"
    base = json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(tiny_model_dir.resolve())
    card = (export / "README.md").read_text()
    assert "library_name: peft" in card and "2 optimizer steps" in card
    # the base as the config names it: no absolute path of this machine, no base_model the Hub would refuse
    assert str(tiny_model_dir.parent) not in card and "base_model:" not in card
    assert f"adapter for `{tiny_model_dir.name}`" in card
    monkeypatch.chdir(tmp_path)  # loads from anywhere
    assert AutoPeftModelForCausalLM.from_pretrained(export) is not None
