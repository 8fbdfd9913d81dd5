"""``scheduler:`` — the learning-rate schedule, sized in optimizer steps."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from posttrain.config.base import BaseConfig, ModeKeys, Problem
from posttrain.config.human import HumanFloat, HumanInt


class SchedulerConfig(BaseConfig):
    type: str = ""
    """Scheduler factory type. Defaults to the trainer's first accepted scheduler (``huggingface``)."""

    lr: HumanFloat | None = Field(default=None, alias="learning_rate")
    """Deprecated: the learning rate belongs in ``optimizer.lr``. Refused when it disagrees with it."""


#: ``transformers.SchedulerType``'s names as of transformers 5 (a unit test keeps them equal): a config that
#: names one of these validates without importing transformers, which costs seconds before ``validate`` answers
KNOWN_SCHEDULES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)


def _hf_scheduler_names() -> tuple[str, ...]:
    """transformers' schedule names (its ``SchedulerType``), read from its source: importing the enum imports
    torch, seconds before a typo could be said."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    source = Path(spec.origin).with_name("trainer_utils.py") if spec and spec.origin else None
    if source is not None and source.is_file():
        for node in ast.parse(source.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name == "SchedulerType":
                return tuple(
                    item.value.value
                    for item in node.body
                    if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant)
                )
    from transformers import SchedulerType  # laid out otherwise: the enum itself

    return tuple(member.value for member in SchedulerType)


class HFSchedulerConfig(SchedulerConfig):
    name: str = "linear"
    """Any ``transformers.get_scheduler`` name: linear, cosine, cosine_with_restarts, polynomial, constant,
    constant_with_warmup, inverse_sqrt, reduce_lr_on_plateau, cosine_with_min_lr, warmup_stable_decay..."""

    warmup_ratio: HumanFloat = Field(default=0.1, ge=0.0, le=1.0)
    """Fraction of the total optimizer steps spent warming up linearly from 0 to the peak LR."""

    warmup_steps: HumanInt | None = Field(default=None, ge=0)
    """Optimizer steps of warmup, in place of ``warmup_ratio`` (TrainingArguments' and Axolotl's
    ``warmup_steps``). Null: ``warmup_ratio`` decides."""

    scheduler_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the scheduler (e.g. ``num_cycles``, ``power``, ``min_lr_rate``,
    ``num_decay_steps``), passed through to ``transformers.get_scheduler``."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value in KNOWN_SCHEDULES:
            return value
        names = _hf_scheduler_names()  # a newer transformers may know more
        if value not in names:
            raise ValueError(f"unknown scheduler name {value!r}; allowed: {', '.join(names)}")
        return value

    def problems(self) -> Iterator[Problem]:
        if self.name in ("reduce_lr_on_plateau", "greedy"):
            yield Problem(
                "name",
                f"{self.name!r} needs a metric each step and is not supported yet (the LR follows the plan)",
            )
            return
        if (
            "warmup_ratio" in self.model_fields_set
            and self.warmup_ratio > 0
            and self.warmup_steps is not None
        ):
            yield Problem(
                "warmup_steps",
                f"{self.warmup_steps}: set warmup_steps or warmup_ratio, not both (warmup_steps wins in "
                "TrainingArguments; here the choice is written once)",
            )
        if self.name == "constant" and "warmup_ratio" in self.model_fields_set and self.warmup_ratio > 0:
            yield Problem(
                "warmup_ratio",
                f"{self.warmup_ratio}: the constant schedule has no warmup; use name: constant_with_warmup "
                "or warmup_ratio: 0",
            )
        if self.name == "constant" and self.warmup_steps:
            yield Problem(
                "warmup_steps",
                f"{self.warmup_steps}: the constant schedule has no warmup; use name: constant_with_warmup "
                "or warmup_steps: 0",
            )
        accepted = _scheduler_arguments(self.name) if self.scheduler_kwargs else set()
        for key in sorted(set(self.scheduler_kwargs) - accepted):
            allowed = ", ".join(sorted(accepted)) or "none"
            yield Problem(
                f"scheduler_kwargs.{key}",
                f"is not an argument of the {self.name!r} schedule; allowed: {allowed}",
            )


#: arguments posttrain fills in itself
_FILLED = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch", "kwargs"}


def warmup_steps(config: HFSchedulerConfig, total_steps: int) -> int:
    """The warmup's length in optimizer steps: ``warmup_steps`` when set, else ``warmup_ratio`` of the run
    (rounded up)."""
    if config.warmup_steps is not None:
        return min(config.warmup_steps, total_steps)
    return math.ceil(config.warmup_ratio * total_steps)


def _scheduler_arguments(name: str) -> set[str]:
    """The extra keyword arguments transformers' schedule function for ``name`` takes."""
    import inspect

    from transformers import SchedulerType
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

    function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    return set(inspect.signature(function).parameters) - _FILLED


class MegatronSchedulerConfig(SchedulerConfig):
    """Megatron-Bridge's schedule family: warmup from ``lr_warmup_init`` to the peak LR, then a decay to
    ``min_lr``; optionally a weight-decay schedule. Counted in optimizer steps."""

    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(
            ("lr_wsd_decay_style", "lr_wsd_decay_iters"),
            lambda c, root: c.lr_decay_style == "WSD",
            "scheduler.lr_decay_style: WSD",
        ),
        ModeKeys(
            ("power", "lr_end"),
            lambda c, root: c.lr_decay_style == "polynomial",
            "scheduler.lr_decay_style: polynomial",
        ),
        ModeKeys(
            ("start_weight_decay", "end_weight_decay"),
            lambda c, root: c.weight_decay_incr_style != "constant",
            "scheduler.weight_decay_incr_style: linear or cosine",
        ),
        ModeKeys(
            ("lr_warmup_init",),
            lambda c, root: bool(c.lr_warmup_iters or c.lr_warmup_fraction),
            "a warmup (scheduler.lr_warmup_iters or lr_warmup_fraction)",
        ),
    )

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD", "polynomial"] = (
        "linear"
    )
    """Decay after warmup: constant, linear, cosine, inverse-square-root, WSD (warmup-stable-decay) or
    polynomial (``power``, ``lr_end``)."""

    lr_decay_iters: HumanInt | None = Field(default=None, ge=1)
    """Steps from the start of training to the end of the decay (warmup included). Null: all steps."""

    lr_warmup_iters: HumanInt = Field(default=0, ge=0)
    """Steps of linear warmup from ``lr_warmup_init`` to the peak LR (exclusive with ``lr_warmup_fraction``)."""

    lr_warmup_fraction: HumanFloat | None = Field(default=None, ge=0.0, le=1.0)
    """Warmup length as a fraction of ``lr_decay_iters`` (exclusive with ``lr_warmup_iters``)."""

    lr_warmup_init: HumanFloat = Field(default=0.0, ge=0.0)
    """The learning rate warmup starts from."""

    min_lr: HumanFloat = Field(default=0.0, ge=0.0)
    """The floor of every decay style; the LR after the decay ends."""

    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    """WSD: shape of the final anneal (linear, cosine, exponential, minus_sqrt)."""

    lr_wsd_decay_iters: HumanInt | None = Field(default=None, ge=1)
    """WSD: length of the final anneal in steps (required for WSD); the LR is flat at its peak before it."""

    power: HumanFloat = Field(default=1.0, gt=0.0)
    """Polynomial: the exponent of the decay (ERNIEKit's ``power``)."""

    lr_end: HumanFloat | None = Field(default=None, ge=0.0)
    """Polynomial: the LR the decay ends at (ERNIEKit's ``lr_end``). Null: ``min_lr``."""

    start_weight_decay: HumanFloat | None = Field(default=None, ge=0.0)
    """Weight decay at step 0. Null: ``optimizer.weight_decay`` (with ``end_weight_decay``: both null)."""

    end_weight_decay: HumanFloat | None = Field(default=None, ge=0.0)
    """Weight decay at the last step. Null: ``optimizer.weight_decay``."""

    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from ``start_weight_decay`` to ``end_weight_decay`` over the run
    (only on parameters that take weight decay at all)."""

    def problems(self) -> Iterator[Problem]:
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            yield Problem("lr_warmup_fraction", "set lr_warmup_iters or lr_warmup_fraction, not both")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None:
            yield Problem(
                "lr_wsd_decay_iters", "lr_decay_style WSD needs the anneal length lr_wsd_decay_iters"
            )
        if self.lr_decay_style != "WSD" and self.lr_wsd_decay_iters is not None:
            yield Problem(
                "lr_wsd_decay_iters", f"only used with lr_decay_style WSD (is {self.lr_decay_style})"
            )
        both = self.start_weight_decay is not None and self.end_weight_decay is not None
        if self.weight_decay_incr_style != "constant" and not both:
            yield Problem(
                "weight_decay_incr_style",
                f"{self.weight_decay_incr_style!r} needs start_weight_decay and end_weight_decay",
            )
        if (
            self.weight_decay_incr_style == "constant"
            and both
            and self.start_weight_decay != self.end_weight_decay
        ):
            yield Problem(
                "end_weight_decay",
                "differs from start_weight_decay but weight_decay_incr_style is constant; "
                "set weight_decay_incr_style: linear or cosine",
            )
