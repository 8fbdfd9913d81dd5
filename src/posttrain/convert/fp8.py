"""Other systems' FP8 settings as posttrain's ``model.fp8`` (torchao's float8 training recipes), or one line
saying why a setting has no counterpart. ERNIEKit turns FP8 on with ``weight_quantize_algo: fp8_linear``;
Megatron-Bridge with a ``mixed_precision`` recipe name (``bf16_with_fp8_current_scaling_mixed``, the perf
scripts' ``fp8_cs``...) or the recipe's fields (``fp8``, ``fp8_recipe``...) under ``mixed_precision`` or
``model``. A file's FP8 fields are read together before any key is converted (``read_megatron``), so each
field's line knows whether FP8 is on whatever the order of the keys."""

from __future__ import annotations

from typing import Any

from posttrain.convert.base import APPROX, NOT_NEEDED, Conversion, NotNeeded, Rule, Unsupported

#: Megatron's scaling recipes (``fp8_recipe``) and the perf scripts' compute types -> torchao's recipe, with
#: what differs; None: no counterpart (the reason)
MEGATRON_RECIPES: dict[str, tuple[str | None, str]] = {
    "tensorwise": ("tensorwise", "current per-tensor scaling, as torchao's tensorwise"),
    "delayed": (
        "tensorwise",
        "delayed scaling (an amax history) becomes current scaling: torchao scales each tensor by its own "
        "amax at every step",
    ),
    "mxfp8": (
        None,
        "MXFP8 needs the block-scaled matrix units of Blackwell GPUs and is not offered; use the "
        "tensorwise recipe (model.fp8: tensorwise)",
    ),
    "blockwise": (
        None,
        "128x128 blockwise scaling has no torchao training recipe; model.fp8: rowwise scales per row",
    ),
}
COMPUTE_TYPES = {"fp8_cs": "tensorwise", "fp8_ds": "delayed", "fp8_mx": "mxfp8", "fp8_sc": "blockwise"}


def _fp8_line(conv: Conversion, recipe: str, source: str, note: str) -> str:
    conv.set("model.fp8", recipe, source)
    return f"model.fp8: {recipe} ({note})"


# ------------------------------------------------------------------ ERNIEKit


def erniekit_fp8_on(flat: dict[str, Any]) -> bool:
    """Whether an ERNIEKit file trains in FP8 (``weight_quantize_algo: fp8_linear`` or ``compute_type: fp8``)."""
    return flat.get("weight_quantize_algo") == "fp8_linear" or flat.get("compute_type") == "fp8"


def erniekit_quantize(conv: Conversion, key: str, value: Any) -> str:
    """``weight_quantize_algo``: ``fp8_linear`` is FP8 training of the linear layers; the weight-only
    integer algorithms are not supported."""
    if value == "fp8_linear":
        return _fp8_line(
            conv,
            "tensorwise",
            key,
            "ERNIEKit's FP8 QAT keeps FP8 weights with static per-tensor scales; torchao's tensorwise recipe "
            "casts high-precision weights with a dynamic per-tensor scale at every step",
        )
    raise Unsupported(
        "weight-only quantised (int4/int8) training is not supported; QLoRA is model.quantization_config"
    )


def erniekit_fp8_setting(no_counterpart: str, when_on: str = "") -> Any:
    """An ERNIEKit FP8 setting: not needed while FP8 is off; with FP8 on, ``when_on`` (not needed, and why)
    or, for a true value, ``no_counterpart`` (not supported, and why)."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if not conv.scratch.get("fp8"):
            raise NotNeeded(
                "an FP8 setting, and FP8 is off (neither weight_quantize_algo: fp8_linear nor compute_type: fp8)"
            )
        if when_on:
            raise NotNeeded(when_on)
        if value:
            raise Unsupported(no_counterpart)
        raise NotNeeded("off; nothing to carry over")

    return apply


# ------------------------------------------------------------------ Megatron-Bridge


def read_megatron(data: dict[str, Any], conv: Conversion) -> None:
    """The file's FP8 fields, read together (``mixed_precision`` as a mapping, or the model provider's)."""
    fields: dict[str, Any] = {}
    for section in ("model", "mixed_precision"):
        if isinstance(data.get(section), dict):
            fields.update({k: v for k, v in data[section].items() if k.startswith(("fp8", "fp4"))})
    named = data.get("mixed_precision")
    if isinstance(named, str) and "fp8" in named.replace("-", "_"):  # a recipe name that turns FP8 on
        fields.setdefault("fp8", "hybrid")
    conv.scratch["fp8"] = fields


def _megatron_recipe(name: str) -> tuple[str, str]:
    target, note = MEGATRON_RECIPES.get(name, (None, f"unknown FP8 recipe {name!r}"))
    if target is None:
        raise Unsupported(note)
    return target, note


def megatron_precision_recipe(conv: Conversion, key: str, text: str) -> str | None:
    """A ``mixed_precision`` recipe name or compute type that trains in FP8 (or FP4): model.fp8 set and the
    line's detail, or None for a recipe without FP8."""
    name = text.replace("-", "_")
    if "fp4" in name:
        raise Unsupported(
            "FP4 training is not supported; use bf16_with_fp8_current_scaling_mixed or bf16_mixed"
        )
    if name in COMPUTE_TYPES:
        scaling = COMPUTE_TYPES[name]
    elif "mxfp8" in name:
        scaling = "mxfp8"
    elif "fp8_subchannel" in name or name.startswith("nanov2_"):
        scaling = "blockwise"
    elif "fp8_delayed" in name:
        scaling = "delayed"
    elif "fp8" in name:
        scaling = "tensorwise"
    else:
        return None
    recipe, note = _megatron_recipe(scaling)
    if "current_scaling" in name:
        note += (
            "; Megatron's recipe keeps the first and last transformer layers in bf16, posttrain converts every "
            "layer but the LM head (name layers to keep in model.fp8_filter_fqns)"
        )
    return _fp8_line(conv, recipe, key, note)


def _megatron_format(conv: Conversion, key: str, value: Any) -> str:
    """``fp8: hybrid | e4m3``: FP8 on, with the file's ``fp8_recipe`` (default tensorwise) and ``fp8_wgrad``."""
    if not value:
        raise NotNeeded("off")
    fields = conv.scratch.get("fp8", {})
    recipe, note = _megatron_recipe(str(fields.get("fp8_recipe") or "tensorwise"))
    if fields.get("fp8_wgrad") is False:
        recipe, note = "rowwise_with_gw_hp", "fp8_wgrad: false keeps the weight gradients in high precision"
    fmt = "E4M3 for inputs and weights, E5M2 for gradients" if recipe == "tensorwise" else "E4M3"
    return _fp8_line(conv, recipe, key, f"{note}; torchao's {recipe} casts to {fmt}")


def _megatron_field(note: str, refuse: Any = None) -> Any:
    """A recipe field: not needed (``note`` while FP8 is on), or not supported for a value ``refuse``
    accepts."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if refuse is not None and refuse(value):
            raise Unsupported(note)
        raise NotNeeded(note if conv.scratch.get("fp8", {}).get("fp8") else "an FP8 setting, and FP8 is off")

    return apply


def _layers_at_start(conv: Conversion, key: str, value: Any) -> str:
    count = int(value or 0)
    if not count or not conv.scratch.get("fp8", {}).get("fp8"):
        raise NotNeeded("no layer kept in high precision" if not count else "an FP8 setting, and FP8 is off")
    fqns = [f"layers.{i}." for i in range(count)]
    conv.set("model.fp8_filter_fqns", sorted({*conv.get("model.fp8_filter_fqns", []), *fqns}), key)
    return f"model.fp8_filter_fqns: {fqns}"


def _layers_at_end(conv: Conversion, key: str, value: Any) -> str:
    if not int(value or 0) or not conv.scratch.get("fp8", {}).get("fp8"):
        raise NotNeeded("no layer kept in high precision" if not value else "an FP8 setting, and FP8 is off")
    raise Unsupported(
        "the converter does not know the model's layer count: add the last layers' names to "
        "model.fp8_filter_fqns (layers.N-1. for an N-layer model)"
    )


def _field(prefix: str, name: str, note: str, refuse: Any = None) -> Rule:
    """A recipe field that is not needed (``note``, also the docs' line), or refused for a value ``refuse``
    accepts."""
    return Rule(f"{prefix}.{name}", "", NOT_NEEDED, note, apply=_megatron_field(note, refuse))


def megatron_rules(prefix: str) -> tuple[Rule, ...]:
    """The FP8 fields of Megatron's ``MixedPrecisionConfig`` under ``prefix`` (``mixed_precision`` or
    ``model``, the provider that receives them)."""
    no_scales = "delayed scaling's setting: torchao scales each tensor by its own amax at every step"
    attention = "attention runs in model.dtype (sdpa or flash); true is not supported"
    return (
        Rule(
            f"{prefix}.fp8",
            "model.fp8",
            APPROX,
            "the recipe from fp8_recipe: tensorwise, delayed as tensorwise, fp8_wgrad false as rowwise_with_gw_hp",
            apply=_megatron_format,
        ),
        _field(prefix, "fp8_recipe", f"read with {prefix}.fp8"),
        _field(prefix, "fp8_wgrad", f"read with {prefix}.fp8"),
        _field(prefix, "fp8_margin", no_scales),
        _field(prefix, "fp8_amax_history_len", no_scales),
        _field(prefix, "fp8_amax_compute_algo", no_scales),
        _field(
            prefix,
            "fp8_param*",
            "the weights stay in model.dtype (ZeRO-3 gathers them so); only the products are FP8",
        ),
        _field(prefix, "fp8_dot_product_attention", attention, lambda v: v is True),
        _field(prefix, "fp8_multi_head_attention", attention, lambda v: v is True),
        _field(prefix, "fp4", "FP4 training is not supported", bool),
        Rule(f"{prefix}.fp4*", "", NOT_NEEDED, "an FP4 setting (FP4 training is not offered)"),
    )


def megatron_layer_rules(prefix: str) -> tuple[Rule, ...]:
    """The fields that keep whole transformer layers out of FP8."""
    return (
        _field(prefix, "first_last_layers_bf16", "num_layers_at_start_in_bf16 and _at_end_in_bf16 say which"),
        Rule(
            f"{prefix}.num_layers_at_start_in_bf16",
            "model.fp8_filter_fqns",
            APPROX,
            "the first layers' names (layers.0. ...)",
            apply=_layers_at_start,
        ),
        Rule(
            f"{prefix}.num_layers_at_end_in_bf16",
            "",
            NOT_NEEDED,
            "0; another count needs the layers' names in model.fp8_filter_fqns",
            apply=_layers_at_end,
        ),
        _field(prefix, "reuse_grad_buf_for_mxfp8_param_ag", "an MXFP8 buffer setting"),
    )
