"""Scheduler ``huggingface``: any ``transformers.get_scheduler`` schedule, sized in optimizer steps."""

from __future__ import annotations

import math

import torch

from posttrain.config.scheduler import HFSchedulerConfig
from posttrain.context import RunContext
from posttrain.registry import SCHEDULERS


@SCHEDULERS.register("huggingface", config=HFSchedulerConfig)
def build_huggingface_scheduler(
    config: HFSchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int, ctx: RunContext
) -> torch.optim.lr_scheduler.LRScheduler:
    from transformers import get_scheduler

    kwargs = dict(config.scheduler_kwargs)
    if config.name == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        kwargs["num_decay_steps"] = max(1, total_steps // 10)
    return get_scheduler(
        config.name,
        optimizer=optimizer,
        num_warmup_steps=math.ceil(config.warmup_ratio * total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=kwargs or None,
    )
