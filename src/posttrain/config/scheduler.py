"""``scheduler:`` — the learning-rate schedule, sized in optimizer steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import Field, field_validator

from posttrain.config.base import BaseConfig, Problem
from posttrain.config.human import HumanFloat


class SchedulerConfig(BaseConfig):
    type: str = ""
    """Scheduler factory type. Defaults to the trainer's first accepted scheduler (``huggingface``)."""

    lr: HumanFloat | None = Field(default=None, alias="learning_rate")
    """Deprecated: the learning rate belongs in ``optimizer.lr``. Refused when it disagrees with it."""


def _hf_scheduler_names() -> tuple[str, ...]:
    from transformers import SchedulerType  # an enum: importing it does no I/O

    return tuple(member.value for member in SchedulerType)


class HFSchedulerConfig(SchedulerConfig):
    name: str = "linear"
    """Any ``transformers.get_scheduler`` name: linear, cosine, cosine_with_restarts, polynomial, constant,
    constant_with_warmup, inverse_sqrt, reduce_lr_on_plateau, cosine_with_min_lr, warmup_stable_decay..."""

    warmup_ratio: HumanFloat = Field(default=0.1, ge=0.0, le=1.0)
    """Fraction of the total optimizer steps spent warming up linearly from 0 to the peak LR."""

    scheduler_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the scheduler (e.g. ``num_cycles``, ``power``, ``min_lr_rate``,
    ``num_decay_steps``), passed through to ``transformers.get_scheduler``."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        names = _hf_scheduler_names()
        if value not in names:
            raise ValueError(f"unknown scheduler name {value!r}; allowed: {', '.join(names)}")
        return value

    def problems(self) -> Iterator[Problem]:
        if self.name == "reduce_lr_on_plateau":
            yield Problem("name", "'reduce_lr_on_plateau' needs a metric each step and is not supported yet")
