"""Scheduler ``huggingface``: any ``transformers.get_scheduler`` schedule, sized in optimizer steps.

transformers' warmups (all but ``cosine_warmup_with_min_lr``'s) start at 0: the first optimizer step would
run at lr 0 and be spent moving nothing. Here warmup counts the update being made (step ``s < warmup`` runs at the schedule's value for ``s + 1``), so
the first update runs at ``peak / warmup_steps`` and the last warmup update at the peak; after the warmup the
schedule is transformers' own, step for step."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from posttrain.config.scheduler import HFSchedulerConfig
from posttrain.context import RunContext


def build_huggingface_scheduler(
    config: HFSchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int, ctx: RunContext
) -> torch.optim.lr_scheduler.LRScheduler:
    from transformers import get_scheduler

    kwargs = dict(config.scheduler_kwargs)
    if config.name == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        kwargs["num_decay_steps"] = max(1, total_steps // 10)
    warmup = math.ceil(config.warmup_ratio * total_steps)
    scheduler = get_scheduler(
        config.name,
        optimizer=optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=kwargs or None,
    )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) or scheduler.lr_lambdas[0](0) > 0:
        return scheduler  # no warmup, or one that counts the update already (cosine_warmup_with_min_lr)
    # the same optimizer again: its groups keep `initial_lr`, the first scheduler's base
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [partial(_counting_the_update, f, warmup) for f in scheduler.lr_lambdas]
    )


def _counting_the_update(factor: Callable[[int], float], warmup: int, step: int) -> float:
    return factor(step + 1 if step < warmup else step)
