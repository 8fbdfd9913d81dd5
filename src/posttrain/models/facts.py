"""What the run needs to know about a model, reported by its factory: read from the checkpoint's config
before the weights exist (ZeRO-3 needs the DeepSpeed config, and so the hidden size, before building), or
from the built model when a factory cannot say beforehand."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from posttrain.models.dimensions import read_dimensions
from posttrain.models.moe import MoEFacts, moe_facts_from_dimensions
from posttrain.models.peft import base_model
from posttrain.vision.processor import is_vision_language

#: the parts of a gated MLP, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (LLaMA, Qwen, Mistral...)
GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


@dataclass(frozen=True)
class ModelFacts:
    """The model facts a run uses: DeepSpeed bucket sizes (``hidden_size``), the default ``data.max_length``
    (``max_positions``), what sequence parallelism splits (``attention_heads``, ``kv_heads``), whether the
    tiled MLP applies (``mlp``: the MLP classes and whether they are gated, known once the model is built), and
    a mixture-of-experts model's routing (``moe``)."""

    model_type: str
    architecture: str
    hidden_size: int | None
    max_positions: int | None
    attention_heads: int | None
    kv_heads: int | None
    vocab_size: int | None
    dtype: str | None = None  # the checkpoint's weight dtype (``model.dtype: auto``), e.g. "bfloat16"
    mlp: tuple[str, ...] = ()  # MLP class names of the built model
    gated_mlp: bool | None = None  # None: not known before the model is built
    moe: MoEFacts | None = None  # the routing of a mixture-of-experts model; None: dense
    vision: bool = False  # a vision-language model (its config has a vision tower's)


def facts_from_hf_config(config: Any) -> ModelFacts:
    """Facts from a transformers ``PretrainedConfig`` (the text part of a multimodal one)."""
    dims = read_dimensions(config)
    architectures = getattr(config, "architectures", None) or [type(config).__name__]
    return ModelFacts(
        model_type=dims.model_type,
        architecture=str(architectures[0]),
        hidden_size=dims.hidden or None,
        max_positions=dims.max_positions or None,
        attention_heads=dims.heads or None,
        kv_heads=dims.kv_heads or None,
        vocab_size=dims.vocab or None,
        dtype=_dtype_name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)),
        moe=moe_facts_from_dimensions(dims),
        vision=is_vision_language(config),
    )


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def mlp_modules(model: Any) -> list[Any]:
    """The feed-forward blocks of a built model: modules whose class name ends in ``MLP``."""
    return [module for module in model.modules() if type(module).__name__.endswith("MLP")]


def is_gated_mlp(module: Any) -> bool:
    return all(hasattr(module, part) for part in GATED_MLP_PARTS)


def facts_from_model(model: Any, before: ModelFacts | None = None) -> ModelFacts | None:
    """Facts completed from a built model: its MLP shape, and everything else when the factory could not
    report it before building."""
    base = base_model(model)
    config = getattr(base, "config", None)
    facts = before or (facts_from_hf_config(config) if config is not None else None)
    if facts is None:
        return None
    mlps = mlp_modules(base)
    names = tuple(sorted({type(m).__name__ for m in mlps}))
    return replace(facts, mlp=names, gated_mlp=bool(mlps) and all(is_gated_mlp(m) for m in mlps))
