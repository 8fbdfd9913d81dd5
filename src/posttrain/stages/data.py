"""The data plan: everything ``train``, ``preprocess`` and ``plot-lr`` must agree on before a first step — the
maximum length, the data (built, or opened from the cache), ``min_iterations`` repetition, and how many
micro-batches each optimizer step takes. One function computes it for all three, so they count the same."""

from __future__ import annotations

import itertools
import math
from typing import Any

from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.data.cache import load_datasets
from posttrain.logs import get_logger, say
from posttrain.models.facts import ModelFacts
from posttrain.plan import BatchSizes, DataPlan, resolve_intervals, step_plan
from posttrain.registry import MODEL_FACTORIES, TRAINERS, load_component


def model_facts(config: TrainerConfig) -> ModelFacts | None:
    """What the model factory can tell before building the model (None when it cannot)."""
    return MODEL_FACTORIES.get(config.model.type).obj.facts(config.model)


def max_length_for(config: TrainerConfig, facts: ModelFacts | None, announce: bool = True) -> int:
    """``data.max_length`` as set, else the model's maximum positions (``max_position_embeddings``)."""
    if "max_length" in config.data.model_fields_set:
        return config.data.max_length
    found = facts.max_positions if facts is not None else None
    if isinstance(found, int):
        if announce:
            get_logger().info("data.max_length not set: using the model's max_position_embeddings=%d", found)
        return found
    return config.data.max_length


def micro_batches_per_rank(samples: int, sizes: BatchSizes) -> int:
    """What ``len(DataLoader)`` is on each rank (the sampler pads every rank to the same count)."""
    return math.ceil(math.ceil(samples / sizes.world_size) / sizes.micro_batch_size)


def _steps(config: TrainerConfig, samples: int, sizes: BatchSizes) -> tuple[list[list[int]], int, int]:
    """The step plan, the run's total steps and its epochs. ``train_iters`` beyond what ``epochs`` holds: when
    ``epochs`` was left at its default, as many epochs as the steps need (Hugging Face's ``max_steps``);
    when it was set, the run ends with its last epoch and the total (and so the schedule) says so. The
    method's schedule says what the plan counts of the samples and how many updates each batch makes."""
    sequences, updates = load_component(TRAINERS.get(config.type).obj.schedule)(config, samples, sizes)
    micro, epochs, rampup = micro_batches_per_rank(sequences, sizes), config.epochs, config.rampup_batch_size
    plan = _updates(step_plan(micro, epochs, sizes, rampup), updates)
    available = sum(len(steps) for steps in plan[:epochs])
    wanted = config.train_iters
    if wanted and wanted < available and "epochs" in config.model_fields_set:
        get_logger().warning(
            "epochs=%d is not honoured: train_iters=%d ends the run after %d of their %d steps; leave "
            "train_iters out (or 0) to train the epochs",
            epochs,
            wanted,
            wanted,
            available,
        )
    if not wanted or wanted <= available or available == 0:
        return plan, wanted or available, epochs
    if "epochs" in config.model_fields_set:
        get_logger().warning(
            "train_iters=%d is more than the %d steps of epochs=%d: the run ends after %d steps (the schedule "
            "is sized for them); raise epochs, or leave it out to run %d steps",
            wanted,
            available,
            epochs,
            available,
            wanted,
        )
        return plan, available, epochs
    # an epoch takes fewest steps once a ramped-up batch is full: an upper bound, then trimmed
    plan = _updates(step_plan(micro, epochs + math.ceil(wanted / len(plan[-1])), sizes, rampup), updates)
    totals = itertools.accumulate(len(steps) for steps in plan)
    epochs = next(number for number, total in enumerate(totals, start=1) if total >= wanted)
    say(f"train_iters={wanted}: {epochs} epochs of the data (epochs was left at its default)")
    return plan[:epochs], wanted, epochs


def _updates(plan: list[list[int]], updates: int) -> list[list[int]]:
    """Each batch's optimizer steps: ``updates`` of them, each over the batch's micro-batches."""
    return [[size for size in steps for _ in range(updates)] for steps in plan]


def plan_data(
    ctx: RunContext, sizes: BatchSizes, lr: float, tokenizer: Any, facts: ModelFacts | None
) -> DataPlan:
    """Build or open the data for ``ctx.config`` (already resolved for the world size) and plan the steps."""
    config = ctx.config
    max_length = max_length_for(config, facts)
    data = load_datasets(ctx, tokenizer, max_length)
    plan, total, epochs = _steps(config, len(data.train), sizes)
    repeats = 1
    steps = sum(
        len(epoch) for epoch in plan[: max(1, config.epochs)]
    )  # optimizer steps, as the method counts
    if config.min_iterations and steps < config.min_iterations:
        repeats = math.ceil(config.min_iterations / max(steps, 1))
        data.train = data.train.repeat(repeats)
        say(f"min_iterations={config.min_iterations}: training data repeated {repeats}x")
        plan, total, epochs = _steps(config, len(data.train), sizes)
    if epochs != config.epochs:
        derived = set(config._derived)
        config = config.model_copy(update={"epochs": epochs})
        config._derived = derived
    config, notes = resolve_intervals(config, total)
    for note in notes:
        say(note)
    return DataPlan(config, sizes, lr, tokenizer, max_length, data, plan, total, repeats)
