"""Optimizer ``adamw``: torch AdamW with no weight decay on biases and norm weights."""

from __future__ import annotations

import re

import torch

from posttrain.config.optimizer import OptimizerConfig
from posttrain.context import RunContext
from posttrain.models.expert_parallel import expert_group_name

_LAYER = re.compile(r"\.layers?\.(\d+)\.|\.h\.(\d+)\.|\.blocks?\.(\d+)\.")


def layer_ratio(name: str, num_layers: int, bound: float) -> float:
    """Layer-wise LR ratio: ``bound`` for the embeddings, rising linearly over the decoder layers to 1 for
    everything above them (final norm, LM head). Depth 0 is the embeddings, depth ``num_layers + 1`` the top."""
    if bound >= 1.0 or num_layers == 0:
        return 1.0
    match = _LAYER.search(name)
    if match:
        depth = int(next(g for g in match.groups() if g is not None)) + 1
    elif "embed" in name or ".wte." in name or ".wpe." in name:
        depth = 0
    else:
        depth = num_layers + 1
    return bound + (1.0 - bound) * depth / (num_layers + 1)


def _num_layers(model: torch.nn.Module) -> int:
    found = {
        int(next(g for g in m.groups() if g is not None))
        for n, _ in model.named_parameters()
        if (m := _LAYER.search(n))
    }
    return max(found) + 1 if found else 0


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    lr: float,
    lora_plus_scale: float = 1.0,
    layerwise_lr_decay_bound: float = 1.0,
) -> list[dict]:
    """Decay matrices (ZeRO-3's partitioned ones too); never biases, norm weights or other 1-D parameters.
    Frozen parameters are left out.
    Each group's LR is ``lr`` times its ratio: LoRA+ (``lora_plus_scale``) for the LoRA B matrices, and the
    layer-wise decay ratio. ``use_weight_decay`` tells weight-decay schedules which groups to change. Sharded
    expert weights (expert parallelism) get groups of their own, as DeepSpeed needs."""
    num_layers = _num_layers(model) if layerwise_lr_decay_bound < 1.0 else 0
    groups: dict[tuple[bool, float, str], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # a ZeRO-3 parameter holds an empty placeholder; its own shape is ``ds_shape``
        ndim = len(getattr(param, "ds_shape", param.shape))
        decay = not (ndim < 2 or name.endswith(".bias") or name.endswith("_bias"))
        ratio = lora_plus_scale if lora_plus_scale != 1.0 and ".lora_B." in name else 1.0
        ratio *= layer_ratio(name, num_layers, layerwise_lr_decay_bound)
        groups.setdefault((decay, ratio, expert_group_name(param) or ""), []).append(param)
    return [
        {
            "params": params,
            "weight_decay": weight_decay if decay else 0.0,
            "use_weight_decay": decay,
            "lr": lr * ratio,
            # DeepSpeed partitions and reduces a group marked ``moe`` over its expert-parallel group ``name``
            **({"moe": True, "name": experts} if experts else {}),
        }
        for (decay, ratio, experts), params in sorted(
            groups.items(), key=lambda item: (not item[0][0], item[0][1], item[0][2])
        )
    ]


def adam_arguments(config: OptimizerConfig, model: torch.nn.Module) -> tuple[list[dict], dict]:
    """The parameter groups and hyper-parameters every Adam variant takes (``adamw``, ``cpu_adam``,
    ``fused_adam``). ``config.lr`` is the effective LR (the run resolves multiplier and batch-size scaling
    into it)."""
    groups = param_groups(
        model, config.weight_decay, config.lr, config.lora_plus_scale, config.layerwise_lr_decay_bound
    )
    hyper = {"lr": config.lr, "betas": config.betas, "eps": config.eps, "weight_decay": config.weight_decay}
    return groups, hyper


def build_adamw(config: OptimizerConfig, model: torch.nn.Module, ctx: RunContext) -> torch.optim.Optimizer:
    groups, hyper = adam_arguments(config, model)
    return torch.optim.AdamW(groups, **hyper, foreach=True)
