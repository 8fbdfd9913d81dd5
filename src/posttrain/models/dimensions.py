"""The one reader of a model's dimensions from its Hugging Face config.

Model configs name the same quantity in several ways (``hidden_size`` or ``d_model``, ``num_local_experts`` or
``num_experts``), leave some out (``head_dim``, ``num_key_value_heads``) and nest the language model inside a
multimodal one. Every part of posttrain that needs a dimension (the facts a run checks, the memory plan, the
FLOPs meter, sequence parallelism, per-document attention, mixture-of-experts routing) reads it here, so a
fallback is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: where model configs keep their hidden size, first found wins
HIDDEN_SIZE_KEYS = ("hidden_size", "hidden_sizes", "d_model", "n_embd")
#: what per-document attention does not compute (it takes sliding windows, ``Dimensions.sliding_window``)
ATTENTION_EXTRAS = ("attn_logit_softcapping", "attention_dropout")


@dataclass(frozen=True)
class Dimensions:
    """A causal LM's dimensions. Zero where the config does not say (a custom architecture)."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int  # the query heads when the config names no key/value heads (no GQA)
    head_dim: int  # ``head_dim`` when given, else hidden / heads
    vocab: int
    intermediate: int  # the dense MLP's width (0 when not given)
    max_positions: int
    tied_head: bool  # the LM head shares the input embedding's weight
    num_experts: int = 0  # experts per MoE layer (0: dense)
    top_k: int = 0  # experts per token
    router_aux_loss_coef: float = 0.0
    sliding_window: int = 0  # 0: none
    attn_logit_softcapping: float = 0.0
    attention_dropout: float = 0.0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def text_config(config: Any) -> Any:
    """The language model's part of a (possibly multimodal) transformers config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _attribute(config: Any, name: str) -> Any:
    """``config.name``; for an attribute that a heterogeneous config sets per layer (transformers'
    ``per_layer_config``: Gemma 4's ``head_dim``, larger on its full-attention layers), which the config
    refuses to give as one value, every layer's value, as a list."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return [getattr(layer, name, None) for layer in config.per_layer_config]


def _numbers(value: Any) -> list[int | float]:
    values = value if isinstance(value, list | tuple) else [value]
    return [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]


def _int(config: Any, *names: str) -> int:
    """The first of ``names`` the config sets to an int; the largest, for a list (per layer)."""
    for name in names:
        found = [v for v in _numbers(_attribute(config, name)) if isinstance(v, int)]
        if found:
            return max(found)
    return 0


def _float(config: Any, name: str) -> float:
    found = _numbers(_attribute(config, name))
    return float(max(found)) if found else 0.0


def read_dimensions(config: Any) -> Dimensions:
    """The dimensions of a transformers ``PretrainedConfig`` (its text part)."""
    text = text_config(config)
    hidden = _int(text, *HIDDEN_SIZE_KEYS)
    heads = _int(text, "num_attention_heads", "n_head")
    experts = _int(text, "num_local_experts", "num_experts")
    top_k = _int(text, "num_experts_per_tok")
    tied = getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))
    return Dimensions(
        model_type=str(getattr(text, "model_type", "") or ""),
        hidden=hidden,
        layers=_int(text, "num_hidden_layers", "n_layer"),
        heads=heads,
        kv_heads=_int(text, "num_key_value_heads") or heads,
        head_dim=_int(text, "head_dim") or (hidden // heads if heads else 0),
        vocab=_int(text, "vocab_size"),
        intermediate=_int(text, "intermediate_size"),
        max_positions=_int(text, "max_position_embeddings", "n_positions"),
        tied_head=bool(tied),
        num_experts=experts if experts >= 2 and top_k else 0,
        top_k=top_k if experts >= 2 else 0,
        router_aux_loss_coef=_float(text, "router_aux_loss_coef"),
        sliding_window=_int(text, "sliding_window"),
        attn_logit_softcapping=_float(text, "attn_logit_softcapping"),
        attention_dropout=_float(text, "attention_dropout"),
    )


def more_than_causal(dims: Dimensions) -> str:
    """Why attention is more than (sliding-window) causal attention for this model ('' when it is not)."""
    for name in ATTENTION_EXTRAS:
        if getattr(dims, name):
            return f"its {name} is {getattr(dims, name)}"
    return ""
