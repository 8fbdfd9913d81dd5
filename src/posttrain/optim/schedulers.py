"""Scheduler ``huggingface``: any ``transformers.get_scheduler`` schedule, sized in optimizer steps.

transformers' warmups (all but ``cosine_warmup_with_min_lr``'s) start at 0: the first optimizer step would
run at lr 0 and be spent moving nothing. Here warmup counts the update being made (step ``s < warmup`` runs at the schedule's value for ``s + 1``), so
the first update runs at ``peak / warmup_steps`` and the last warmup update at the peak (a one-step smoke run
too); after the warmup the schedule is transformers' own, step for step. A schedule that leaves steps at
learning rate 0 is said in one line."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from posttrain.config.scheduler import HFSchedulerConfig, warmup_steps
from posttrain.context import RunContext
from posttrain.logs import say


def build_huggingface_scheduler(
    config: HFSchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int, ctx: RunContext
) -> torch.optim.lr_scheduler.LRScheduler:
    from transformers import get_scheduler

    kwargs = dict(config.scheduler_kwargs)
    if config.name == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        kwargs["num_decay_steps"] = max(1, total_steps // 10)
    warmup = warmup_steps(config, total_steps)
    scheduler = get_scheduler(
        config.name,
        optimizer=optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=kwargs or None,
    )
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and scheduler.lr_lambdas[0](0) == 0:
        # the same optimizer again: its groups keep `initial_lr`, the first scheduler's base
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, [partial(_counting_the_update, f, warmup) for f in scheduler.lr_lambdas]
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        say_idle_steps(scheduler.lr_lambdas[0], total_steps, f"scheduler {config.name}")
    return scheduler


def _counting_the_update(factor: Callable[[int], float], warmup: int, step: int) -> float:
    """The warmup's ramp one step on (the last warmup update at the peak, even where the warmup takes the
    whole run: transformers' decay would put that step at 0)."""
    if step >= warmup:
        return factor(step)
    return 1.0 if step + 1 == warmup else factor(step + 1)


def say_idle_steps(lr_at: Callable[[int], float], total_steps: int, name: str) -> None:
    """One line when some of the run's optimizer steps would train at learning rate 0 (nothing moves on
    them): a schedule that ends or stays at 0 before the run does."""
    idle = [step for step in range(total_steps) if lr_at(step) == 0]
    if not idle:
        return
    where = f"step {idle[0] + 1}" if len(idle) == 1 else f"{len(idle)} steps, from step {idle[0] + 1}"
    say(
        f"{name}: {where} of the run's {total_steps} train at learning rate 0, and nothing moves on them; "
        "check the schedule against train_iters (plot-lr draws it)"
    )
