"""The run's arithmetic, as pure functions: batch sizes from a total, the effective learning rate, and how
many micro-batches each optimizer step takes (batch-size ramp-up included); and what the run plans from them
(``DataPlan``: the data and its steps; ``Batches``: their loaders), the types the registry's hooks take, here
below the stages that fill them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from posttrain.config.trainer import TrainerConfig
from posttrain.errors import UserError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from posttrain.data.build import Datasets
    from posttrain.data.sampler import ShardSampler


@dataclass(frozen=True)
class BatchSizes:
    """``world_size`` counts data-parallel replicas: processes / ``sequence_parallel_size``."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size


def batch_sizes(config: TrainerConfig, world_size: int) -> BatchSizes:
    """``micro_batch_size`` and ``gradient_accumulation_steps`` as set, or derived from
    ``total_train_batch_size``: the fewest accumulation steps whose micro-batch fits
    ``max_per_device_train_batch_size``."""
    total = config.total_train_batch_size
    if total is None:
        return BatchSizes(config.micro_batch_size, config.gradient_accumulation_steps, world_size)
    if total % world_size:
        raise UserError(
            f"total_train_batch_size={total} cannot be split over {world_size} processes; "
            f"use a multiple of {world_size} (e.g. {math.ceil(total / world_size) * world_size})"
        )
    per_rank = total // world_size
    cap = config.max_per_device_train_batch_size or per_rank
    gas = next(g for g in range(1, per_rank + 1) if per_rank % g == 0 and per_rank // g <= cap)
    return BatchSizes(per_rank // gas, gas, world_size)


def data_parallel_size(config: TrainerConfig, world_size: int) -> int:
    """Replicas that read different samples: the ranks of a sequence-parallel group share theirs."""
    sp = config.sequence_parallel_size
    if world_size % sp:
        raise UserError(
            f"sequence_parallel_size={sp} must divide the world size {world_size}; "
            f"run on a multiple of {sp} processes or lower it"
        )
    return world_size // sp


def resolve(config: TrainerConfig, world_size: int) -> tuple[TrainerConfig, BatchSizes, float]:
    """The config with batch sizes and the effective LR filled in for this world size; the checks of the
    batch sizes (ramp-up, the method's own) made here, before any data is built or model loaded."""
    sizes = batch_sizes(config, data_parallel_size(config, world_size))
    check_sizes(config, sizes)
    lr = config.optimizer.effective_lr(sizes.global_batch_size)
    resolved = config.model_copy(
        update={
            "micro_batch_size": sizes.micro_batch_size,
            "gradient_accumulation_steps": sizes.gradient_accumulation_steps,
            "optimizer": config.optimizer.model_copy(update={"lr": lr}),
        }
    )
    derived = set(config._derived)
    if config.total_train_batch_size is not None:
        derived |= {("micro_batch_size",), ("gradient_accumulation_steps",)}
    if lr != config.optimizer.lr:
        derived.add(("optimizer", "lr"))
    resolved._derived = derived
    return resolved, sizes, lr


def interval_steps(value: int | float, total_steps: int) -> int:
    """A step interval as steps: a whole number as is, a fraction below 1 of ``total_steps`` rounded up
    (at least 1), as Hugging Face resolves ``eval_steps: 0.2``."""
    if isinstance(value, float) and 0 < value < 1:
        return max(1, math.ceil(value * total_steps))
    return int(value)


def resolve_intervals(config: TrainerConfig, total_steps: int) -> tuple[TrainerConfig, list[str]]:
    """The config with every step interval given as a fraction turned into steps, and a line for each."""
    notes: list[str] = []

    def steps(name: str, value: int | float) -> int:
        resolved = interval_steps(value, total_steps)
        if resolved != value:
            notes.append(f"{name}: {value:g} of the run's {total_steps} steps = every {resolved} steps")
        return resolved

    checkpoints = [
        c.model_copy(
            update={"save_every_n_steps": steps(f"checkpoint[{i}].save_every_n_steps", c.save_every_n_steps)}
        )
        for i, c in enumerate(config.checkpoint)
    ]
    update = {
        "eval_interval": steps("eval_interval", config.eval_interval),
        "loss_log_interval": steps("loss_log_interval", config.loss_log_interval),
        "checkpoint": checkpoints,
    }
    if not notes:
        return config, notes
    resolved = config.model_copy(update=update)
    resolved._derived = set(config._derived)
    return resolved, notes


def lr_explanation(config: TrainerConfig, sizes: BatchSizes, lr: float) -> str:
    optimizer = config.optimizer
    parts = [f"{optimizer.lr:g}"]
    if optimizer.lr_multiplier != 1.0:
        parts.append(f"x {optimizer.lr_multiplier:g} (lr_multiplier)")
    if optimizer.lr_batch_size_scaling != "none":
        ratio = f"{sizes.global_batch_size}/{optimizer.lr_reference_batch_size}"
        factor = f"sqrt({ratio})" if optimizer.lr_batch_size_scaling == "sqrt" else ratio
        parts.append(f"x {factor} ({optimizer.lr_batch_size_scaling} batch-size scaling)")
    return f"learning rate {lr:g}" + (f" = {' '.join(parts)}" if len(parts) > 1 else "")


def one_update_per_sample(config: TrainerConfig, samples: int, sizes: BatchSizes) -> tuple[int, int]:
    """The default ``schedule`` hook (``registry.Schedule``): every sample is a training sequence, every batch one
    optimizer step."""
    return samples, 1


def step_plan(
    micro_batches_per_epoch: int, epochs: int, sizes: BatchSizes, rampup: tuple[int, int, int] | None
) -> list[list[int]]:
    """Micro-batches per optimizer step, for each epoch. Without ramp-up every step takes
    ``gradient_accumulation_steps`` (the last of an epoch may take fewer). With ``rampup_batch_size``
    ``[start, increment, samples]`` the global batch starts at ``start`` and grows by ``increment`` after
    every ``samples / intervals`` consumed samples until it reaches the configured global batch."""
    per_micro = sizes.micro_batch_size * sizes.world_size
    target = sizes.global_batch_size
    consumed = 0
    plan = []
    for _ in range(max(epochs, 1)):
        left, steps = micro_batches_per_epoch, []
        while left > 0:
            batch = target if rampup is None else ramped_batch(rampup, target, consumed)
            take = min(batch // per_micro, left)
            steps.append(take)
            left -= take
            consumed += take * per_micro
        plan.append(steps)
    return plan


def ramped_batch(rampup: tuple[int, int, int], target: int, consumed: int) -> int:
    start, increment, samples = rampup
    intervals = (target - start) // increment
    if intervals <= 0:
        return target
    per_interval = samples / intervals
    return min(target, start + increment * int(consumed // per_interval))


def made_of(sizes: BatchSizes) -> str:
    """How a global batch is made, for messages."""
    return (
        f"micro-batch {sizes.micro_batch_size} x accumulation {sizes.gradient_accumulation_steps} x "
        f"{sizes.world_size} processes"
    )


def check_sizes(config: TrainerConfig, sizes: BatchSizes) -> None:
    """The batch sizes' checks once the world size is known: ramp-up and the method's own (grpo: a global
    batch of whole groups). One error naming every problem."""
    problems = rampup_problems(config.rampup_batch_size, sizes)
    problems += [
        f"{key}: {message}" for key, message in config.batch_problems(sizes.global_batch_size, made_of(sizes))
    ]
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        raise UserError("the batch sizes do not fit:\n  - " + "\n  - ".join(problems))


def rampup_problems(rampup: tuple[int, int, int] | None, sizes: BatchSizes) -> list[str]:
    if rampup is None:
        return []
    start, increment, _ = rampup
    unit = sizes.micro_batch_size * sizes.world_size
    target = sizes.global_batch_size
    problems = []
    if start % unit or increment % unit:
        problems.append(f"start and increment must be multiples of micro_batch_size x world size = {unit}")
    if start > target:
        problems.append(f"start {start} is above the global batch size {target}")
    elif (target - start) % increment:
        problems.append(
            f"global batch {target} - start {start} is not a multiple of the increment {increment}"
        )
    return [f"rampup_batch_size={list(rampup)}: " + "; ".join(problems)] if problems else []


@dataclass
class DataPlan:
    config: TrainerConfig  # resolved for the world size (batch sizes, LR)
    sizes: BatchSizes
    lr: float
    tokenizer: Any
    max_length: int
    data: Datasets
    step_plan: list[list[int]]  # micro-batches per optimizer step, per epoch
    total_steps: int
    repeats: int = 1  # copies of the training data (min_iterations)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.step_plan[0])

    def summary(self) -> dict[str, Any]:
        """The plan's numbers as data (``posttrain preprocess --json``)."""
        return {
            "train_sequences": len(self.data.train),
            "eval_sequences": len(self.data.eval),
            "max_length": self.max_length,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "global_batch_size": self.sizes.global_batch_size,
            "micro_batch_size": self.sizes.micro_batch_size,
            "gradient_accumulation_steps": self.sizes.gradient_accumulation_steps,
            "learning_rate": self.lr,
        }


@dataclass
class Batches:
    """The run's data as the loop reads it: the plan, the collator, the training loader and its sampler, the
    evaluation loader."""

    plan: DataPlan
    collator: Any
    train: DataLoader
    sampler: ShardSampler
    eval: DataLoader | None
