"""The memory plan of a run, for ``posttrain preprocess`` (the whole plan) and for ``train`` before it loads
the model (``check_memory``): stop with the plan when the host cannot hold the model states the config
keeps there, warn when a GPU's estimated peak is above its memory."""

from __future__ import annotations

import os
from dataclasses import replace

from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.errors import UserError
from posttrain.logs import get_logger
from posttrain.memory.estimate import MemoryPlan, plan
from posttrain.memory.fixes import fits
from posttrain.memory.machine import Machine, detect
from posttrain.memory.report import gib, plan_text
from posttrain.memory.settings import settings_for
from posttrain.memory.shape import ShapeUnavailable, model_shape


def memory_plan(
    config: TrainerConfig, world_size: int, machine: Machine, tokens_per_row: int, image_tokens: int = 0
) -> MemoryPlan:
    """The plan of one process of ``config`` (resolved for ``world_size``) on ``machine``, for rows of at
    most ``tokens_per_row`` tokens of which at most ``image_tokens`` are image tokens."""
    shape = model_shape(config.model)
    settings = settings_for(config, shape, world_size, tokens_per_row, machine.device, image_tokens)
    return plan(replace(settings, gpu_memory=machine.device_memory or 0.0), shape)


def check_before_loading(ctx: RunContext, tokens_per_row: int) -> None:
    """``train``'s check: rows of up to ``tokens_per_row`` tokens (the data is not built yet, so the longest
    row is the bound). The host's model states decide (they do not depend on the data); a GPU's peak over
    its memory, and a host peak over it only by activations, get a warning."""
    config = ctx.config
    if not config.check_memory:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.dist.world_size))
    machine = detect(local)
    if ctx.dist.device.type != "cuda":
        machine = Machine("cpu", None, machine.host_memory, local, "CPU")
    try:
        memory = memory_plan(config, ctx.dist.world_size, machine, tokens_per_row)
    except ShapeUnavailable as error:
        if ctx.dist.is_main:
            get_logger().warning("check_memory: no memory plan for this model (%s); going on without", error)
        return
    states = sum(i.bytes for i in memory.items if i.place == "host" and i.phase == "states")
    if states * local > machine.host_memory:
        raise UserError(
            f"check_memory: the host cannot hold what this run keeps in its memory: {gib(states)} per process "
            f"x {local} processes, {gib(machine.host_memory)} available\n"
            + plan_text(memory, machine)
            + "\n(set check_memory: false to start anyway)"
        )
    device_ok, host_ok = fits(memory, machine)
    if ctx.dist.is_main and not (device_ok and host_ok):
        where = "a GPU" if not device_ok else "the host"
        get_logger().warning(
            "check_memory: the estimated peak is above what %s has (GPU %s of %s, host %s of %s, rows of up "
            "to %s tokens); `posttrain preprocess` prints the plan and the cheapest changes that fit",
            where,
            gib(memory.device_peak),
            gib(machine.device_memory),
            gib(memory.host_peak * local),
            gib(machine.host_memory),
            f"{tokens_per_row:,}",
        )
