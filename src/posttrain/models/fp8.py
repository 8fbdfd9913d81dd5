"""``model.fp8``: the linear layers' matrix products in float8, through torchao's float8 training.

torchao swaps each chosen ``nn.Linear`` for its ``Float8Linear`` (a subclass, same parameters, same names):
every forward casts the input and the weight to float8 with dynamic scales (per tensor or per row, the
recipe's), multiplies them on the FP8 matrix units, and backward does the same with the gradients. The
weights, their gradients and the optimizer keep the run's dtype, so checkpoints and exports are plain
high-precision state dicts. Left in high precision: the LM head (its logits feed the loss directly), LoRA
adapters (small, and trained), and layers whose sizes the FP8 kernels cannot take (not multiples of 16) or
that ``fp8_filter_fqns`` names. On a device without FP8 matrix units (a CPU, a GPU before Ada/Hopper) the
run uses torchao's emulation: the same casts and scales, products in float32, never faster.

The choice of layers is a pure function of the module tree (:func:`choose_layers`), so the pre-flight report
and the memory plan name the same layers on a model built on the meta device as the run converts.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.config.fp8 import AUTO_FILTER, TORCHAO_INSTALL
from posttrain.config.trainer import TrainerConfig
from posttrain.errors import UserError
from posttrain.logs import say
from posttrain.models.peft import base_model

#: why a linear layer stays in high precision
HEAD, ADAPTER, SHAPE, FILTERED, SMALL = (
    "the LM head",
    "LoRA adapters, trained in high precision",
    "sizes not multiples of 16",
    "named in fp8_filter_fqns",
    "too small to gain (auto_filter_small_kn)",
)
#: the least CUDA compute capability whose matrix units run each recipe's float8 products
FP8_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0), "rowwise_with_gw_hp": (9, 0)}


@dataclass(frozen=True)
class Fp8Layers:
    """The linear layers of a model under a recipe: those converted to float8 and those kept, with why."""

    converted: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (module name, reason)
    converted_elements: int  # weight elements of the converted layers
    linear_elements: int  # weight elements of every linear layer
    largest: int  # the largest converted weight (elements)
    widest: int  # the most input or output features of a converted layer

    def summary(self, recipe: str, dtype: str) -> str:
        """One line: what runs in float8 and what does not, and why."""
        share = self.converted_elements / self.linear_elements if self.linear_elements else 0.0
        line = (
            f"fp8 {recipe}: {len(self.converted)} linear layers multiply in float8 ({share:.0%} of the linear "
            "weights)"
        )
        by_reason: dict[str, list[str]] = defaultdict(list)
        for name, reason in self.kept:
            by_reason[reason].append(_short(name))
        if by_reason:
            parts = [f"{_names(names)} ({reason})" for reason, names in by_reason.items()]
            line += f"; left in {dtype}: " + "; ".join(parts)
        return line


def _short(name: str) -> str:
    """A module name without PEFT's wrapper prefix."""
    return name.removeprefix("base_model.model.")


def _names(names: list[str]) -> str:
    if len(names) <= 3:
        return ", ".join(names)
    return f"{len(names)} layers ({', '.join(names[:2])}, ...)"


def _adapter_ids(model: torch.nn.Module) -> set[int]:
    """The modules of PEFT's adapters: everything inside a tuner layer but its ``base_layer``."""
    found: set[int] = set()
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(base, torch.nn.Module):
            continue
        inside = {id(m) for m in base.modules()}
        found.update(id(m) for m in module.modules() if id(m) not in inside and m is not module)
    return found


def _head_ids(model: torch.nn.Module) -> set[int]:
    base = base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return {id(m) for m in head.modules()} if isinstance(head, torch.nn.Module) else set()


def _small(recipe: str) -> Any:
    """torchao's rule for layers too small to gain from a recipe (the rowwise rule for rowwise_with_gw_hp,
    which torchao's auto filter does not cover)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    rule = _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, [])
    return lambda module, name: not rule(module, name)


def choose_layers(model: torch.nn.Module, recipe: str, filter_fqns: list[str]) -> Fp8Layers:
    """Which linear layers of ``model`` the recipe converts (works on the meta device)."""
    heads, adapters = _head_ids(model), _adapter_ids(model)
    fqns = [f for f in filter_fqns if f != AUTO_FILTER]
    small = _small(recipe) if AUTO_FILTER in filter_fqns else None
    converted: list[str] = []
    kept: list[tuple[str, str]] = []
    elements = total = largest = widest = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        size = module.in_features * module.out_features
        if id(module) in heads:
            kept.append((name, HEAD))
            continue
        if id(module) in adapters:
            kept.append((name, ADAPTER))
            continue
        total += size
        if module.in_features % 16 or module.out_features % 16:
            kept.append((name, SHAPE))
        elif any(f in name for f in fqns):
            kept.append((name, FILTERED))
        elif small is not None and small(module, name):
            kept.append((name, SMALL))
        else:
            converted.append(name)
            elements += size
            largest = max(largest, size)
            widest = max(widest, module.in_features, module.out_features)
    return Fp8Layers(tuple(converted), tuple(kept), elements, total, largest, widest)


def emulation_reason(recipe: str, device: torch.device) -> str:
    """Why ``device`` cannot run the recipe's float8 products ("" when it can)."""
    if device.type != "cuda":
        return f"this {device.type.upper()} has no FP8 matrix units"
    capability = torch.cuda.get_device_capability(device)
    needed = FP8_CAPABILITY[recipe]
    if capability < needed:
        have, need = ".".join(map(str, capability)), ".".join(map(str, needed))
        name = torch.cuda.get_device_name(device)
        return f"{name} (compute capability {have}) has no FP8 matrix units for {recipe} (needs {need})"
    return ""


def run_device() -> torch.device:
    """The device this process trains on (the model is converted before the engine moves it there)."""
    from posttrain.utils.imports import accelerator

    if accelerator() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def torchao_config(recipe: str, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` of the recipe (its emulation where the device has no FP8 units)."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as error:
        raise UserError(f"model.fp8: {recipe} needs torchao ({error}): {TORCHAO_INSTALL}") from None
    # pad_inner_dim: a product's inner size that is not a multiple of 16 (a row's token count, in the weight
    # gradient) is padded for the FP8 kernel, which refuses it; under torch.compile with dynamic lengths it is
    # what proves the size right to the compiler
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert(model: torch.nn.Module, recipe: str, layers: Fp8Layers, emulate: bool) -> int:
    """Swap the chosen layers for torchao's ``Float8Linear``; the number swapped."""
    from torchao.float8 import convert_to_float8_training

    chosen = set(layers.converted)
    convert_to_float8_training(
        model, module_filter_fn=lambda _, fqn: fqn in chosen, config=torchao_config(recipe, emulate)
    )
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")


def fp8_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: ``model.fp8``, after adapters exist (they stay in high precision) and before
    ``compile`` (which then fuses the casts into the blocks)."""
    recipe = config.model.fp8
    if recipe is None:
        return model
    layers = choose_layers(model, recipe, config.model.fp8_filter_fqns)
    if not layers.converted:
        raise UserError(
            f"model.fp8: {recipe} finds no linear layer to run in float8 in {type(base_model(model)).__name__} "
            f"({len(layers.kept)} kept: {layers.summary(recipe, config.model.dtype).split('; ', 1)[-1]}); "
            "set model.fp8: null"
        )
    why = emulation_reason(recipe, run_device())
    convert(model, recipe, layers, emulate=bool(why))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    line = layers.summary(recipe, dtype)
    if why:
        line += f"; emulated: {why} (torchao's emulation runs the same numerics in float32, never faster)"
    say(line)
    return model
