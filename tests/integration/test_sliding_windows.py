"""Per-layer sliding windows under packing: models that mix sliding and full attention layers (EXAONE-4,
Gemma-2/3/4, Qwen2 with ``max_window_layers``) and Mistral's window on every layer give the padded batch's loss
and gradients when their documents are packed into one row, on both attention paths (the per-document loop
and the varlen call over the stand-in kernels). EXAONE-4 keeps the config's window on every layer's module
and passes ``sliding_window=None`` from its full layers: the call's value decides."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.data.collate import Collator, HostPrepared
from posttrain.data.packing import join_samples
from posttrain.errors import UserError
from posttrain.models import document_attention
from posttrain.models.document_attention import use_document_attention
from posttrain.models.token_logps import row_nll
from tests import varlen_stand_ins as stand_ins
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration

WINDOW = 8
#: the same small shape for every family: 2 layers, 4 query heads over 2 key/value heads of size 16
SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
ALTERNATING = ["sliding_attention", "full_attention"]


def _exaone4() -> torch.nn.Module:
    from transformers import Exaone4Config, Exaone4ForCausalLM

    return Exaone4ForCausalLM(Exaone4Config(**SHAPE, sliding_window=WINDOW, layer_types=ALTERNATING))


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **SHAPE,
        sliding_window=WINDOW,
        layer_types=ALTERNATING,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=None,  # soft-capped attention keeps transformers' masked row
        final_logit_softcapping=None,
    )
    return Gemma2ForCausalLM(config)


def _gemma3() -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **SHAPE, sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=16
    )
    return Gemma3ForCausalLM(config)


def _gemma4() -> torch.nn.Module:
    """Gemma 4's text model: its full layers' heads wider than its sliding layers' (``global_head_dim``),
    which makes its config give ``head_dim`` per layer only (a heterogeneous config)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        **SHAPE,
        global_head_dim=32,
        sliding_window=WINDOW,
        layer_types=ALTERNATING,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=SHAPE["vocab_size"],
    )
    return Gemma4ForCausalLM(config)


def _qwen2() -> torch.nn.Module:
    """``use_sliding_window`` from layer ``max_window_layers`` on: layer 0 full, layer 1 sliding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return Qwen2ForCausalLM(config)


def _mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=WINDOW))


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "exaone4": _exaone4,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "qwen2": _qwen2,
    "mistral": _mistral,
}
#: transformers' attention for the padded reference (Gemma-2 has no sdpa path; eager is per-document too)
IMPLEMENTATION = {"gemma2": "eager"}
#: the window each layer's varlen call must get (window_size's left side: W - 1, or -1 for none)
LEFT = {
    "exaone4": [WINDOW - 1, -1],
    "gemma2": [WINDOW - 1, -1],
    "gemma3": [WINDOW - 1, -1],
    "gemma4": [WINDOW - 1, -1],
    "qwen2": [-1, WINDOW - 1],
    "mistral": [WINDOW - 1, WINDOW - 1],
}


def _model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]().to(dtype).train()


def _samples(seed: int = 0) -> list[dict[str, list[int]]]:
    """Eight documents of 4 to 40 tokens: most longer than the window, some inside it."""
    rng = np.random.default_rng(seed)
    return [
        {"input_ids": rng.integers(5, 1000, n).tolist(), "labels": rng.integers(5, 1000, n).tolist()}
        for n in rng.integers(4, 40, size=8)
    ]


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The per-token loss (as the loop divides it) and the gradients."""
    model.zero_grad()
    loss = row_nll(model, batch).sum() / batch["num_target_tokens"]
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def _padded_and_packed(family: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The padded batch through transformers' own masks (sliding and full per layer) and the same documents
    packed in one row through per-document attention, as (loss, gradients) each."""
    samples = _samples()
    padded = Collator(0)(samples)
    packed = HostPrepared(Collator(0))([join_samples(samples)])
    assert packed["max_length_q"] > WINDOW > min(len(s["input_ids"]) for s in samples)
    implementation = IMPLEMENTATION.get(family, "sdpa")
    masked = _model(family, dtype)
    masked.set_attn_implementation(implementation)
    reference = _loss_and_grads(masked, padded)
    model = _model(family, dtype)
    model.set_attn_implementation(implementation)
    assert use_document_attention(model) == ""
    return reference, _loss_and_grads(model, packed)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_equals_padded_on_the_per_document_loop(family: str) -> None:
    (loss, grads), (ours, our_grads) = _padded_and_packed(family, torch.float32)
    assert abs(float(loss - ours)) < 1e-5, (float(loss), float(ours))
    for name, grad in grads.items():
        assert torch.allclose(grad, our_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_equals_padded_on_the_varlen_path(family: str) -> None:
    """bf16 over the stand-in kernels: one varlen call per layer, each with its layer's window."""
    with stand_ins.varlen_on_cpu(stand_ins.varlen_2_13):
        (loss, _), (ours, _) = _padded_and_packed(family, torch.bfloat16)
        assert stand_ins.CALLS == ["2.13", "2.13"]
        assert LEFT[family] == stand_ins.WINDOWS
    assert abs(float(loss - ours)) < 2e-2, (float(loss), float(ours))


def test_a_config_that_sets_the_head_size_per_layer_is_read_at_its_largest() -> None:
    """Gemma 4's config refuses ``head_dim`` as one value (its full layers' heads are wider): the dimensions
    take every layer's and keep the largest, the bound the memory plan wants, instead of failing."""
    from posttrain.models.dimensions import read_dimensions

    dimensions = read_dimensions(_gemma4().config)
    assert (dimensions.head_dim, dimensions.sliding_window, dimensions.layers) == (32, WINDOW, 2)


def test_a_window_on_the_full_layers_would_be_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: reading the module's window when the call passes None (the defect) makes EXAONE-4's
    packed loss differ from the padded one by far more than the tolerance above."""
    monkeypatch.setattr(
        document_attention,
        "layer_window",
        lambda module, kwargs: int(kwargs.get("sliding_window") or getattr(module, "sliding_window", 0) or 0),
    )
    (loss, _), (ours, _) = _padded_and_packed("exaone4", torch.float32)
    assert abs(float(loss - ours)) > 1e-3, (float(loss), float(ours))


def test_a_window_longer_than_every_document_changes_nothing() -> None:
    """With the window longer than every document, packed and padded rows agree whatever the layer types."""
    model = _model("exaone4", torch.float32)
    model.config.sliding_window = 64
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 64
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    samples = _samples()
    loss = _loss_and_grads(reference, Collator(0)(samples))[0]
    model.set_attn_implementation("sdpa")
    use_document_attention(model)
    ours = _loss_and_grads(model, HostPrepared(Collator(0))([join_samples(samples)]))[0]
    assert abs(float(loss - ours)) < 1e-5


def test_attention_sinks_are_refused_for_rows_of_documents(
    base_config: dict, tiny_moe_dirs: dict[str, Path]
) -> None:
    """GPT-OSS's attention sinks (a learned logit per head in every softmax) are more than causal attention,
    and transformers' GPT-OSS builds its masks without the positions, so its masked row would attend across
    documents (its packed loss differs from the padded one): a packed run stops before training, in a line."""
    from posttrain.tiny_model import build_model

    model = build_model(1024, hidden_size=64, heads=4, seed=0, arch="gpt_oss").float()
    model.set_attn_implementation("eager")  # transformers has no sdpa path for the sinks
    samples = _samples()
    padded = _loss_and_grads(copy.deepcopy(model), Collator(0)(samples))[0]
    crossed = _loss_and_grads(copy.deepcopy(model), Collator(0)([join_samples(samples)]))[0]
    assert abs(float(padded - crossed)) > 1e-3
    assert "sinks" in use_document_attention(model)
    assert model.config._attn_implementation == "eager"
    config = merge(
        base_config,
        model={"name_or_path": str(tiny_moe_dirs["gpt_oss"]), "attn_implementation": "eager"},
        data={"pack_samples": True},
        micro_batch_size=1,
    )
    with pytest.raises(UserError, match=r"data\.pack_samples: true, but its attention has sinks"):
        train(config)


def test_exaone4_trains_the_same_step_packed_and_padded(
    base_config: dict, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    """Through the trainer: one step on eight chats, packed into one row or padded, gives one loss."""
    model_dir = tmp_path / "exaone4"
    config = {
        **SHAPE,
        "vocab_size": len(tiny_tokenizer),
        "sliding_window": WINDOW,
        "layer_types": ALTERNATING,
    }
    from transformers import Exaone4Config, Exaone4ForCausalLM

    torch.manual_seed(0)
    Exaone4ForCausalLM(Exaone4Config(**config)).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    run = merge(base_config, model={"name_or_path": str(model_dir)}, train_iters=1, loss_log_interval=1)
    run["data"]["sources"] = [{"name_or_path": run["data"]["sources"][0], "sample_count": 8}]
    padded = train(merge(run, micro_batch_size=8, logger={"output_dir": str(tmp_path / "padded")}))
    packed = train(
        merge(
            run,
            micro_batch_size=1,
            data={"pack_samples": True, "max_length": 1024},
            logger={"output_dir": str(tmp_path / "packed")},
        )
    )
    losses = [r.state.history[0]["loss"] for r in (padded, packed)]
    assert packed.state.history[0]["tokens"] == padded.state.history[0]["tokens"]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5), losses
