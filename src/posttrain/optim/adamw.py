"""Optimizer ``adamw``: torch AdamW with no weight decay on biases and norm weights."""

from __future__ import annotations

import torch

from posttrain.config.optimizer import OptimizerConfig
from posttrain.context import RunContext
from posttrain.registry import OPTIMIZERS


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never biases, norm weights or other 1-D parameters. Frozen parameters are left out."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


@OPTIMIZERS.register("adamw", config=OptimizerConfig)
def build_adamw(config: OptimizerConfig, model: torch.nn.Module, ctx: RunContext) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        foreach=True,
    )
