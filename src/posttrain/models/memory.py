"""Memory features of a built model: activation checkpointing, its CPU offload, and the tiled MLP.

They change where and when activations live, never the numbers: each has a test that the loss and every
gradient equal the plain model's.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from posttrain.config.trainer import TrainerConfig
from posttrain.errors import UserError
from posttrain.models.facts import is_gated_mlp, mlp_modules
from posttrain.models.peft import base_model


def apply_activation_checkpointing(model: torch.nn.Module, enabled: bool, offload: bool = False) -> None:
    """Checkpoint every decoder layer (transformers' non-reentrant path), optionally keeping the saved
    layer inputs on the CPU; the KV cache is off in training either way."""
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    if not enabled:
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        offload_checkpoints(model)


# ------------------------------------------------------------------------------------ checkpoint offload


class OffloadCounter:
    """How many layer inputs went to the host (the tests read it)."""

    stored = 0


class _ToHost(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.device = x.device
        OffloadCounter.stored += 1
        if x.device.type == "cpu":
            return x.detach().view_as(x)
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        return host.copy_(x, non_blocking=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.to(ctx.device, non_blocking=True)


class _ToDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, device: torch.device) -> torch.Tensor:  # type: ignore[override]
        return x.to(device, non_blocking=True) if x.device != device else x.detach().view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.to("cpu", non_blocking=True), None


def offloaded_checkpoint(function: Any, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """transformers' per-layer checkpoint call, with the layer input kept on the host: the checkpoint holds
    only the host copy and brings it back to the device to recompute the layer in backward."""
    device = hidden.device
    stored = _ToHost.apply(hidden)

    def layer(host: torch.Tensor, *rest: Any, **named: Any) -> Any:
        return function(_ToDevice.apply(host, device), *rest, **named)

    return checkpoint(layer, stored, *args, use_reentrant=False, **kwargs)


def offload_checkpoints(model: torch.nn.Module) -> int:
    """Swap the checkpoint function of every checkpointed layer; returns how many layers use it."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for module in layers:
        module._gradient_checkpointing_func = offloaded_checkpoint
    if not layers:
        raise UserError(
            f"activation_checkpoint_cpu_offload: {type(model).__name__} has no checkpointed layers to offload"
        )
    return len(layers)


# --------------------------------------------------------------------------------------------- tiled MLP


def _gated(module: Any, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


#: this forward's agreed tile count per local sequence length (ZeRO-3): read once per forward, not per layer
_AGREED_TILES: dict[int, int] = {}


def _tile_count(module: Any, x: torch.Tensor) -> int:
    """About hidden-size tokens per tile. Under ZeRO-3 each tile gathers the weights (a collective), so
    every rank takes the largest count of all ranks; they agree once per forward (the first tiled MLP of
    the forward asks, the rest and the recomputation in backward reuse it), not once per layer."""
    tiles = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
    if not (hasattr(module.down_proj.weight, "ds_id") and torch.distributed.is_initialized()):
        return tiles
    agreed = _AGREED_TILES.get(x.shape[-2])
    if agreed is None:
        count = torch.tensor(tiles, device=x.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        agreed = _AGREED_TILES[x.shape[-2]] = int(count.item())
    return agreed


def _new_forward(*_: Any) -> None:
    """A forward pre-hook on the model: every rank asks again at the start of each forward (a rank whose
    length did not change must still join the others' collective)."""
    _AGREED_TILES.clear()


def _tiled_forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    params = [p for p in module.parameters() if p.requires_grad]
    return TiledMLP.apply(_gated, module, x, _tile_count(module, x), params)


def tile_mlps(model: torch.nn.Module) -> int:
    """Route every gated MLP through DeepSpeed's ``TiledMLP`` (sequence tiles, recomputed in backward);
    any other MLP shape is refused. Returns how many MLPs were tiled."""
    base = base_model(model)
    mlps = mlp_modules(base)
    other = sorted({type(m).__name__ for m in mlps if not is_gated_mlp(m)})
    if not mlps or other:
        found = ", ".join(other) or "no module named *MLP"
        raise UserError(
            f"tiled_mlp_compute: {type(base).__name__} has {found}; the tiled MLP computes gated MLPs "
            "(gate_proj, up_proj, down_proj, act_fn as in LLaMA, Qwen, Mistral); set tiled_mlp_compute: false"
        )
    for module in mlps:
        module.forward = types.MethodType(_tiled_forward, module)
    base.register_forward_pre_hook(_new_forward)
    return len(mlps)


__all__ = ["OffloadCounter", "apply_activation_checkpointing", "offload_checkpoints", "tile_mlps"]


def checkpointing_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: activation checkpointing (on unless ``model.disable_activation_checkpoint``), before
    adapters wrap the model."""
    enabled = not config.model.disable_activation_checkpoint
    apply_activation_checkpointing(model, enabled, config.activation_checkpoint_cpu_offload)
    return model


def tiled_mlp_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: ``tiled_mlp_compute``."""
    if config.tiled_mlp_compute:
        tile_mlps(model)
    return model
