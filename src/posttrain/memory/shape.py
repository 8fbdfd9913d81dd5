"""The model's shape for the memory plan: parameter counts by part and the sizes activations scale with,
from the checkpoint's ``config.json`` on the meta device (no weight is read, any size takes seconds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from posttrain.config.model import ModelConfig
from posttrain.models.dimensions import read_dimensions
from posttrain.utils.hub import not_found

if TYPE_CHECKING:
    from posttrain.models.fp8 import Fp8Layers


class ShapeUnavailable(Exception):
    """The configured model cannot be built on the meta device (a model class transformers cannot create
    from its config): there is no plan, and the run goes on without one."""


#: module-name pieces that mark a mixture-of-experts layer's experts and its shared expert
EXPERT_MARK, SHARED_MARK = ".experts.", "shared_expert"


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's image encoder (its vision tower): what its activations scale with."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    patches_per_token: float  # encoder positions per image token of the language model (after merging)
    tower_trained: bool  # the tower's parameters get gradients (its activations are kept for backward)
    projector_trained: bool  # the projector's do (it keeps its input, the tower's output)


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts (elements) and dimensions of a causal LM. ``trainable`` counts what gets gradients
    and optimizer state: every parameter, or the adapters of a PEFT run."""

    params: int
    trainable: int
    embedding: int  # input embedding
    head: int  # the LM head when it is not tied to the embedding
    experts: int  # all experts' parameters, every layer
    largest_module: int  # the largest single module (ZeRO-3 gathers one at a time)
    layers: int
    hidden: int
    intermediate: int  # the dense MLP's width (0 when every layer is a mixture of experts)
    q_dim: int  # query heads x head size
    kv_dim: int  # key/value heads x head size
    heads: int
    vocab: int
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    adapter_inputs: int = 0  # per token and layer: the inputs of adapted modules (copied by LoRA dropout)
    gated: bool = True
    dtype: str = "float32"  # the checkpoint's weight dtype (what ``model.dtype: auto`` loads)
    fp8: Fp8Layers | None = None  # the linear layers ``model.fp8`` converts (None: no FP8)
    vision: VisionShape | None = None  # a vision-language model's image encoder

    @property
    def dense(self) -> int:
        """Parameters outside the experts (replicated on every expert-parallel rank)."""
        return self.params - self.experts


def model_shape(model: ModelConfig) -> ModelShape:
    """Build the configured model on the meta device and count it (adapters applied as the run will, the
    linear layers FP8 converts chosen as the run will)."""
    from posttrain.models.huggingface import hf_config as read_config
    from posttrain.vision.freeze import freeze_parts
    from posttrain.vision.processor import auto_model_class

    try:
        hf_config = read_config(model)
    except (OSError, ValueError) as error:
        raise not_found("model.name_or_path", model.name_or_path, error) from None
    try:
        with torch.device("meta"):
            built = auto_model_class(hf_config).from_config(
                hf_config, trust_remote_code=model.trust_remote_code
            )
            built = freeze_parts(built, model)  # a vision-language model's frozen tower and projector
            if model.peft_config is not None:
                from posttrain.models.peft import apply_peft
                from posttrain.vision.freeze import language_adapter_targets

                built = apply_peft(built, language_adapter_targets(built, model.peft_config), None)
        shape = shape_of(built, hf_config)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError) as error:
        raise ShapeUnavailable(f"{type(error).__name__}: {error}") from error
    if model.fp8 is not None:
        from posttrain.models.fp8 import choose_layers

        shape = dataclasses.replace(shape, fp8=choose_layers(built, model.fp8, model.fp8_filter_fqns))
    return shape


@dataclass(frozen=True)
class ScorerShape:
    """A reward model another method holds whole on every process (grpo's ``{model: path}``)."""

    name: str
    params: int
    dtype: str  # its checkpoint's weight dtype (what it loads in)


def _on_meta(key: str, name_or_path: str, auto_class: Any) -> tuple[Any, int]:
    """The model at ``name_or_path`` built by ``auto_class`` on the meta device: its config and parameter
    count (a tied weight once); ``key`` names the config entry in the error when nothing is there."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        raise not_found(key, name_or_path, error) from None
    try:
        with torch.device("meta"):
            model = auto_class.from_config(hf_config)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError) as error:
        raise ShapeUnavailable(f"{key}: {type(error).__name__}: {error}") from error
    return hf_config, sum(p.numel() for p in model.parameters())


def scorer_shape(key: str, name_or_path: str) -> ScorerShape:
    """A one-label sequence classifier at ``name_or_path``: its backbone and the score head (hidden x 1)."""
    from transformers import AutoModel

    hf_config, params = _on_meta(key, name_or_path, AutoModel)
    return ScorerShape(name_or_path, params + read_dimensions(hf_config).hidden, _weight_dtype(hf_config))


def causal_lm_shape(key: str, name_or_path: str, dtype: str | None = None) -> ScorerShape:
    """A whole causal LM at ``name_or_path`` another method holds frozen on every process (distill's teacher),
    LM head included; ``dtype``: what it loads in (default: its checkpoint's)."""
    from transformers import AutoModelForCausalLM

    hf_config, params = _on_meta(key, name_or_path, AutoModelForCausalLM)
    return ScorerShape(name_or_path, params, dtype if dtype and dtype != "auto" else _weight_dtype(hf_config))


def _weight_dtype(hf_config: Any) -> str:
    return str(getattr(hf_config, "dtype", None) or "float32").removeprefix("torch.")


def shape_of(built: torch.nn.Module, hf_config: Any) -> ModelShape:
    """Count a built (meta) model: its parts, and the sizes its activations scale with."""
    dims = read_dimensions(hf_config)
    named = dict(built.named_parameters(remove_duplicate=True))
    unique = {id(p): (name, p) for name, p in named.items()}
    params = sum(p.numel() for _, p in unique.values())
    trainable = sum(p.numel() for _, p in unique.values() if p.requires_grad)
    base = built.get_base_model() if hasattr(built, "get_base_model") else built
    embedding = base.get_input_embeddings().weight
    head_module = base.get_output_embeddings()
    head = head_module.weight if head_module is not None else None
    experts = sum(p.numel() for name, p in unique.values() if EXPERT_MARK in f".{name}.")
    shared = sum(p.numel() for name, p in unique.values() if SHARED_MARK in name and "gate." not in name)
    hidden, layers, num_experts = dims.hidden, dims.layers, dims.num_experts
    moe = experts > 0 and num_experts > 1
    gated = any(hasattr(m, "gate_proj") or hasattr(m, "gate_up_proj") for m in base.modules())
    per_expert = experts / max(1, layers * num_experts) if moe else 0
    return ModelShape(
        params=params,
        trainable=trainable,
        embedding=embedding.numel(),
        head=head.numel() if head is not None and head is not embedding else 0,
        experts=experts if moe else 0,
        largest_module=max(
            (sum(p.numel() for p in m.parameters(recurse=False)) for m in built.modules()), default=0
        ),
        layers=layers,
        hidden=hidden,
        intermediate=0 if moe else dims.intermediate or 4 * hidden,
        q_dim=dims.q_dim,
        kv_dim=dims.kv_dim,
        heads=dims.heads,
        vocab=dims.vocab,
        num_experts=num_experts if moe else 0,
        top_k=dims.top_k if moe else 0,
        expert_intermediate=round(per_expert / ((3 if gated else 2) * hidden)) if moe else 0,
        shared_intermediate=round(shared / max(1, layers) / (3 * hidden)) if shared else 0,
        adapter_inputs=_adapter_inputs(built, layers),
        gated=gated,
        dtype=_weight_dtype(hf_config),
        vision=vision_shape(unique.values(), hf_config),
    )


def patches_per_token(hf_config: Any) -> float:
    """How many of the encoder's positions one image token of the language model stands for: Idefics3 and
    SmolVLM merge ``scale_factor``^2 patches, Qwen-VL ``spatial_merge_size``^2, Gemma 3 pools the patch grid
    to ``mm_tokens_per_image``; LLaVA gives one token a patch (its class token aside)."""
    vision = hf_config.vision_config
    if getattr(hf_config, "scale_factor", None):
        return float(hf_config.scale_factor) ** 2
    if getattr(vision, "spatial_merge_size", None):
        return float(vision.spatial_merge_size) ** 2
    size, patch = getattr(vision, "image_size", 0), getattr(vision, "patch_size", 0)
    pooled = getattr(hf_config, "mm_tokens_per_image", 0)
    if pooled and isinstance(size, int) and isinstance(patch, int) and patch:
        return (size // patch) ** 2 / pooled
    return 1.0


def vision_shape(named: Iterable[tuple[str, torch.nn.Parameter]], hf_config: Any) -> VisionShape | None:
    """The image encoder of a vision-language model (None for a text model), which of its parts train as
    ``freeze_parts`` left them."""
    from posttrain.vision.freeze import part_of
    from posttrain.vision.processor import is_vision_language

    if not is_vision_language(hf_config):
        return None
    trained = {"tower": False, "projector": False}
    for name, parameter in named:
        part = part_of(name)
        if part in trained and parameter.requires_grad:
            trained[part] = True
    vision = hf_config.vision_config
    dims = read_dimensions(vision)
    hidden = int(
        getattr(vision, "embed_dim", 0) or dims.hidden
    )  # Qwen2-VL: hidden_size is the merger's output
    ratio = float(getattr(vision, "mlp_ratio", 0) or 4)
    return VisionShape(
        layers=dims.layers or int(getattr(vision, "depth", 0) or 0),
        hidden=hidden,
        intermediate=dims.intermediate or round(ratio * hidden),
        heads=dims.heads,
        patches_per_token=patches_per_token(hf_config),
        tower_trained=trained["tower"],
        projector_trained=trained["projector"],
    )


def _adapter_inputs(built: torch.nn.Module, layers: int) -> int:
    """Per token and layer, the input features of modules whose LoRA dropout copies their input."""
    total = 0
    for module in built.modules():
        dropout = getattr(module, "lora_dropout", None)
        if not dropout:
            continue
        for drop in dropout.values():
            if isinstance(drop, torch.nn.Dropout) and drop.p > 0:
                total += int(getattr(module, "in_features", 0))
    return total // max(1, layers)
