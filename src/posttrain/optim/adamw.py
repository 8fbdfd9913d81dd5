"""Optimizer ``adamw``: torch AdamW with no weight decay on biases and norm weights."""

from __future__ import annotations

import torch

from posttrain.config.optimizer import OptimizerConfig
from posttrain.context import RunContext
from posttrain.registry import OPTIMIZERS


def param_groups(
    model: torch.nn.Module, weight_decay: float, lr: float, lora_plus_scale: float = 1.0
) -> list[dict]:
    """Decay matrices; never biases, norm weights or other 1-D parameters. Frozen parameters are left out.
    With LoRA+ (``lora_plus_scale`` != 1) the LoRA B matrices get ``lr * lora_plus_scale``."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = not (param.ndim < 2 or name.endswith(".bias"))
        lora_b = lora_plus_scale != 1.0 and ".lora_B." in name
        groups.setdefault((decay, lora_b), []).append(param)
    return [
        {
            "params": params,
            "weight_decay": weight_decay if decay else 0.0,
            "lr": lr * (lora_plus_scale if lora_b else 1.0),
        }
        for (decay, lora_b), params in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))
    ]


@OPTIMIZERS.register("adamw", config=OptimizerConfig)
def build_adamw(config: OptimizerConfig, model: torch.nn.Module, ctx: RunContext) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay, config.lr, config.lora_plus_scale),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        foreach=True,
    )
