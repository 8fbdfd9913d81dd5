"""Scheduler ``megatron``: Megatron-Bridge's LR schedules and weight-decay increment, as pure functions of
the optimizer step, applied to every parameter group in proportion to its own base LR."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from posttrain.config.scheduler import MegatronSchedulerConfig
from posttrain.context import RunContext
from posttrain.optim.schedulers import say_idle_steps


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate at an optimizer step (0-based: step 0 is the LR of the first update).

    Warmup counts the update being made: the first of ``warmup_steps`` updates runs at
    ``warmup_init + (peak - warmup_init) / warmup_steps`` and the last at the peak, so no update is spent at
    ``lr_warmup_init`` (0 by default, where nothing would move); Megatron evaluates the ramp one step
    earlier."""

    peak: float
    min_lr: float
    warmup_init: float
    warmup_steps: int
    decay_steps: int
    style: str
    wsd_style: str = "exponential"
    wsd_steps: int = 0
    power: float = 1.0
    lr_end: float | None = None

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_init + (self.peak - self.warmup_init) * (step + 1) / self.warmup_steps
        if self.style == "constant":
            return self.peak
        end = self.min_lr if self.lr_end is None or self.style != "polynomial" else self.lr_end
        if step >= self.decay_steps:  # as in Megatron, for every style that decays (inverse-square-root too)
            return max(self.min_lr, end)
        if self.style == "inverse-square-root":
            warmup = max(self.warmup_steps, 1)
            return max(self.min_lr, self.peak * math.sqrt(warmup) / math.sqrt(max(step, 1)))
        ratio = (step - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        return max(self.min_lr, end + (self.peak - end) * self._coefficient(step, ratio))

    def _coefficient(self, step: int, ratio: float) -> float:
        """1 at the start of the decay, 0 at its end."""
        if self.style == "linear":
            return 1.0 - ratio
        if self.style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.style == "polynomial":
            return (1.0 - ratio) ** self.power
        # WSD: flat at the peak, then an anneal of wsd_steps that ends with the decay
        anneal_start = self.decay_steps - self.wsd_steps
        if step <= anneal_start:
            return 1.0
        progress = (step - anneal_start) / self.wsd_steps
        return {
            "linear": 1.0 - progress,
            "cosine": 0.5 * (math.cos(math.pi * progress) + 1.0),
            "exponential": 2.0 * 0.5**progress - 1.0,
            "minus_sqrt": 1.0 - math.sqrt(progress),
        }[self.wsd_style]


@dataclass(frozen=True)
class WeightDecaySchedule:
    """Weight decay at an optimizer step: ``start`` at step 0 to ``end`` at ``steps``."""

    start: float
    end: float
    steps: int
    style: str = "constant"

    def __call__(self, step: int) -> float:
        if self.style == "constant":
            return self.start
        ratio = min(step / max(self.steps, 1), 1.0)
        coefficient = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start + coefficient * (self.end - self.start)


class ScheduledLR(torch.optim.lr_scheduler.LRScheduler):
    """Sets every group's LR to ``schedule(step) * group_base / peak`` (so LoRA+ and layer-wise ratios
    keep their proportion), and the weight decay of groups that take it to ``weight_decay(step)``.
    The schedules come from the config, so they are not part of the saved state."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        schedule: LRSchedule,
        weight_decay: WeightDecaySchedule | None = None,
    ) -> None:
        self.schedule = schedule
        self.weight_decay = weight_decay
        self.ratios = [g["lr"] / schedule.peak if schedule.peak else 1.0 for g in optimizer.param_groups]
        self.decays = [g.get("use_weight_decay", g["weight_decay"] > 0) for g in optimizer.param_groups]
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        step = self.last_epoch
        if self.weight_decay is not None:
            value = self.weight_decay(step)
            for group, decays in zip(self.optimizer.param_groups, self.decays, strict=True):
                if decays:
                    group["weight_decay"] = value
        lr = self.schedule(step)
        return [lr * ratio for ratio in self.ratios]

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedule", "weight_decay")}


def schedules(
    config: MegatronSchedulerConfig, peak: float, weight_decay: float, total_steps: int
) -> tuple[LRSchedule, WeightDecaySchedule | None]:
    decay_steps = config.lr_decay_iters or total_steps
    warmup = config.lr_warmup_iters
    if config.lr_warmup_fraction is not None:
        warmup = round(config.lr_warmup_fraction * decay_steps)
    lr = LRSchedule(
        peak=peak,
        min_lr=config.min_lr,
        warmup_init=config.lr_warmup_init,
        warmup_steps=warmup,
        decay_steps=decay_steps,
        style=config.lr_decay_style,
        wsd_style=config.lr_wsd_decay_style,
        wsd_steps=config.lr_wsd_decay_iters or 0,
        power=config.power,
        lr_end=config.lr_end,
    )
    if config.start_weight_decay is None and config.end_weight_decay is None:
        return lr, None
    start = weight_decay if config.start_weight_decay is None else config.start_weight_decay
    end = start if config.end_weight_decay is None else config.end_weight_decay
    return lr, WeightDecaySchedule(start, end, total_steps, config.weight_decay_incr_style)


def build_megatron_scheduler(
    config: MegatronSchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int, ctx: RunContext
) -> ScheduledLR:
    peak = float(optimizer.defaults["lr"])
    lr, weight_decay = schedules(
        config, peak, float(optimizer.defaults.get("weight_decay", 0.0)), total_steps
    )
    say_idle_steps(lr, total_steps, f"scheduler megatron ({config.lr_decay_style})")
    return ScheduledLR(optimizer, lr, weight_decay)
