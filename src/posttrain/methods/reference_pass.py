"""One pass of a frozen model over every stored sample before training, its per-sample values kept beside
the samples (``view.per_sample``): the reference log-probabilities of the DPO family and KTO.

Each distinct stored sample is scored once (each rank its share, then all share by an all-gather), so the
reference takes no memory or time during training, never gets an optimizer, and gives the same values under
every ZeRO stage and process count (the pass runs through the DeepSpeed engine when the policy's initial
weights are the reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from posttrain.context import RunContext
from posttrain.data.views import SampleView
from posttrain.logs import say
from posttrain.models.reference import load_reference_model

#: ``(model, batch on the device) -> {name: one value per sample}``
Scorer = Callable[[Any, dict[str, Any]], dict[str, torch.Tensor]]


@torch.no_grad()
def score_samples(
    ctx: RunContext,
    forward: Any,
    views: list[SampleView],
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]],
    score: Scorer,
    device: torch.device,
) -> None:
    """Score every distinct stored sample of ``views`` once and attach the values to the views' per-sample values
    (per stored sample: 8 bytes per name)."""
    import torch.distributed as dist

    store = views[0].store
    unique = np.unique(np.concatenate([view.samples for view in views]))
    world, rank = ctx.dist.world_size, ctx.dist.rank
    per_rank = math.ceil(len(unique) / world)
    mine = unique[rank::world]
    # equal batch counts keep ZeRO-3 collectives in step
    mine = np.concatenate([mine, np.full(per_rank - len(mine), unique[0] if len(unique) else 0)])
    size = ctx.config.micro_batch_size
    values: dict[str, np.ndarray] = {}
    for start in range(0, len(mine), size):
        batch = collator([views[0].sample_item(int(i)) for i in mine[start : start + size]])
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for name, scores in score(forward, inputs).items():
            values.setdefault(name, np.zeros(len(mine)))[start : start + size] = scores.double().cpu().numpy()
    parts = [(mine, values)]
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, parts[0])
        parts = gathered
    merged = {name: np.zeros(store.count) for name in values}
    for ids, part in parts:
        for name, scores in part.items():
            merged[name][ids] = scores
    for view in views:
        view.per_sample.update(merged)


def reference_pass(
    ctx: RunContext, engine: Any, data: Any, collator: Any, score: Scorer, unit: str = "samples"
) -> None:
    """Score the train and eval samples with the reference: ``ref_model`` when configured, else the policy's
    initial weights (through the engine)."""
    config = ctx.config
    if config.ref_model is not None:
        forward, source = (
            load_reference_model(config.ref_model, ctx).to(engine.device),
            config.ref_model.name_or_path,
        )
    else:
        engine.train(False)
        forward, source = engine, "the policy's initial weights"
    views = [view for view in (data.train, data.eval) if isinstance(view, SampleView)]
    score_samples(ctx, forward, views, collator, score, engine.device)
    engine.train(True)
    say(f"reference log-probabilities computed once for {len(data.train) + len(data.eval)} {unit} ({source})")
