"""The one training loop. Steps are optimizer steps; the loss is normalised per target token over all
micro-batches of a step and all ranks."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.context import RunContext
from posttrain.dist import all_reduce_sum
from posttrain.engine import Engine
from posttrain.logs import say
from posttrain.stops import StopSignals
from posttrain.tracking.metrics import MetricsFile, format_line

LossFn = Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class LoopState:
    """Where training is. ``step``, ``epoch``, ``epoch_step`` and ``evals`` are saved in resumable
    checkpoints; ``epoch_step`` (optimizer steps done in the current epoch) is the position in the data."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    evals: int = 0
    run_steps: int = 0
    stop_reason: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)

    def resumable(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "epoch_step": self.epoch_step, "evals": self.evals}


@dataclass
class LoopInputs:
    engine: Engine
    loss_fn: LossFn
    train_loader: Iterable[dict[str, Any]]
    set_epoch: Callable[[int], None]
    eval_loader: Iterable[dict[str, Any]] | None
    checkpoints: list[Any]
    metrics: MetricsFile
    total_steps: int
    steps_per_epoch: int
    stops: StopSignals


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def group_steps(
    loader: Iterable[dict[str, Any]], gas: int, skip_steps: int = 0
) -> Iterator[list[dict[str, Any]]]:
    """Micro-batches grouped into optimizer steps; the last group of an epoch may be shorter.
    ``skip_steps`` steps are passed over first (resuming in the middle of an epoch)."""
    micro_batches = itertools.islice(iter(loader), skip_steps * gas, None)
    group: list[dict[str, Any]] = []
    for micro in micro_batches:
        group.append(micro)
        if len(group) == gas:
            yield group
            group = []
    if group:
        yield group


def repeat_first(loader: Iterable[dict[str, Any]], gas: int, steps: int) -> Iterator[list[dict[str, Any]]]:
    """``overfit_first_batch``: the first micro-batch as every micro-batch of every step."""
    first = next(iter(loader))
    for _ in range(steps):
        yield [first] * gas


def train_step(
    ctx: RunContext, inputs: LoopInputs, micro_batches: list[dict[str, Any]]
) -> tuple[float, int, int]:
    """One optimizer step. Returns (local summed loss, global target tokens, global input tokens)."""
    engine = inputs.engine
    local_tokens = sum(m["num_target_tokens"] for m in micro_batches)
    local_inputs = sum(m["num_input_tokens"] for m in micro_batches)
    target_tokens, input_tokens = (int(x) for x in all_reduce_sum([local_tokens, local_inputs], ctx.dist))
    # DeepSpeed averages gradients over ranks; multiply back so the result is sum / global tokens.
    scale = ctx.dist.world_size / max(target_tokens, 1)
    loss_sum = torch.zeros((), device=engine.device, dtype=torch.float32)
    for index, micro in enumerate(micro_batches):
        batch = to_device(micro, engine.device)
        loss, _ = inputs.loss_fn(engine, batch)
        engine.micro_step(loss * scale, last=index == len(micro_batches) - 1)
        loss_sum += loss.detach().float()
    return float(loss_sum.item()), target_tokens, input_tokens


@torch.no_grad()
def evaluate(ctx: RunContext, inputs: LoopInputs) -> float:
    """Token-weighted mean loss over the whole eval set, all ranks."""
    engine = inputs.engine
    assert inputs.eval_loader is not None
    engine.train(False)
    loss_sum = torch.zeros((), device=engine.device, dtype=torch.float64)
    tokens = 0
    for micro in inputs.eval_loader:
        loss, _ = inputs.loss_fn(engine, to_device(micro, engine.device))
        loss_sum += loss.double()
        tokens += micro["num_target_tokens"]
    engine.train(True)
    total, count = all_reduce_sum([float(loss_sum.item()), float(tokens)], ctx.dist)
    return total / max(count, 1.0)


def _stop_reason(ctx: RunContext, state: LoopState) -> str:
    """Exit conditions that need no agreement between ranks (every rank computes the same answer)."""
    config = ctx.config
    if config.exit_iteration and state.step >= config.exit_iteration:
        return f"exit_iteration={config.exit_iteration} reached"
    if config.exit_iteration_this_run and state.run_steps >= config.exit_iteration_this_run:
        return f"exit_iteration_this_run={config.exit_iteration_this_run} reached"
    return ""


def _after_step(ctx: RunContext, inputs: LoopInputs, state: LoopState, record: dict[str, Any]) -> None:
    """Evaluate, record, print and save as configured after an optimizer step."""
    config = ctx.config
    if config.eval_interval and state.step % config.eval_interval == 0 and inputs.eval_loader is not None:
        record["eval_loss"] = evaluate(ctx, inputs)
        state.evals += 1
    inputs.metrics.write(record)
    state.history.append(record)
    printed = config.loss_log_interval and state.step % config.loss_log_interval == 0
    eval_printed = (
        "eval_loss" in record
        and config.eval_log_iter_interval
        and state.evals % config.eval_log_iter_interval == 0
    )
    if printed or eval_printed:
        say(format_line(record, inputs.total_steps))
    for checkpoint in inputs.checkpoints:
        if checkpoint.due(step=state.step):
            checkpoint.save(inputs.engine, state)


def _epoch_steps(ctx: RunContext, inputs: LoopInputs, skip_steps: int) -> Iterator[list[dict[str, Any]]]:
    gas = ctx.config.gradient_accumulation_steps
    if ctx.config.overfit_first_batch:
        return repeat_first(inputs.train_loader, gas, inputs.steps_per_epoch - skip_steps)
    return group_steps(inputs.train_loader, gas, skip_steps)


def train_loop(ctx: RunContext, inputs: LoopInputs, state: LoopState) -> LoopState:
    """Train from ``state`` until the epochs or ``train_iters`` are done or an exit condition fires."""
    config = ctx.config
    while state.epoch < config.epochs and not state.stop_reason and state.step < inputs.total_steps:
        inputs.set_epoch(state.epoch)
        for micro_batches in _epoch_steps(ctx, inputs, skip_steps=state.epoch_step):
            started = time.perf_counter()
            loss_sum, tokens, input_tokens = train_step(ctx, inputs, micro_batches)
            state.step += 1
            state.run_steps += 1
            state.epoch_step += 1
            elapsed = time.perf_counter() - started
            local_stop = inputs.stops.check(config.kill_switch_path, elapsed)
            loss_total, *stops = all_reduce_sum([loss_sum, *local_stop], ctx.dist)
            record: dict[str, Any] = {
                "iter": state.step,
                "epoch": state.epoch,
                "loss": loss_total / max(tokens, 1),
                "lr": inputs.engine.lr(),
                "grad_norm": inputs.engine.grad_norm(),
                "tokens": tokens,
                "step_time": elapsed,
                "tokens_per_second": input_tokens / elapsed if elapsed > 0 else None,
                "time": time.time(),
            }
            _after_step(ctx, inputs, state, record)
            state.stop_reason = inputs.stops.reason(stops) or _stop_reason(ctx, state)
            if state.stop_reason or state.step >= inputs.total_steps:
                break
        if state.epoch_step >= inputs.steps_per_epoch:
            state.epoch += 1
            state.epoch_step = 0
            for checkpoint in inputs.checkpoints:
                if checkpoint.due(step=state.step, epoch_end=state.epoch):
                    checkpoint.save(inputs.engine, state)
    return state
