"""The one training loop. Steps are optimizer steps; the loss is normalised per target token over all
micro-batches of a step and all ranks."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.context import RunContext
from posttrain.data.collate import to_device
from posttrain.dist import all_reduce_named, all_reduce_sum
from posttrain.registry import LossFunction
from posttrain.tracking.outputs import RunOutputs
from posttrain.tracking.system import StepMeter
from posttrain.training.engine import Engine
from posttrain.training.extras import COUNT, Evaluator, StepExtra, StepObserver
from posttrain.training.steps import StepFeed
from posttrain.training.stops import StopSignals

HISTORY_RECORDS = 1000


class RecentRecords(list):
    """A list that keeps at most the last ``limit`` to ``2 x limit`` records (trimmed in bulk)."""

    def __init__(self, limit: int = HISTORY_RECORDS) -> None:
        super().__init__()
        self.limit = limit

    def append(self, record: dict[str, Any]) -> None:
        super().append(record)
        if len(self) > 2 * self.limit:
            del self[: -self.limit]


@dataclass
class LoopState:
    """Where training is. ``step``, ``epoch``, ``epoch_step``, ``evals`` and the trackers' run ids are saved
    in resumable checkpoints; ``epoch_step`` (optimizer steps done in the current epoch) is the position in
    the data. ``history`` keeps the last ``HISTORY_RECORDS`` (up to twice that) step records (every record is in the metrics
    file), so nothing grows with the length of the run. ``rank_state``: what a step feed must find again on
    this rank when resuming (grpo: the generated batch its remaining updates train on), saved per rank."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    evals: int = 0
    run_steps: int = 0
    stop_reason: str = ""
    history: RecentRecords = field(default_factory=lambda: RecentRecords())
    tracker_ids: dict[str, str] = field(default_factory=dict)
    rank_state: dict[str, Any] = field(default_factory=dict)  # this rank's, saved with resumable checkpoints
    #: run-long totals a step feed keeps, the same on every rank (grpo's ``num_tokens``), saved with
    #: resumable checkpoints whatever the process count
    counters: dict[str, float] = field(default_factory=dict)

    def resumable(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "epoch_step": self.epoch_step,
            "evals": self.evals,
            "tracker_ids": dict(self.tracker_ids),
            "counters": dict(self.counters),
        }


@dataclass
class LoopInputs:
    engine: Engine
    loss_fn: LossFunction
    steps: StepFeed
    eval_loader: Iterable[dict[str, Any]] | None
    checkpoints: list[Any]
    outputs: RunOutputs
    total_steps: int
    step_plan: list[list[int]]
    stops: StopSignals
    meter: StepMeter
    observers: list[StepObserver] = field(default_factory=list)  # profilers
    perplexity: bool = True
    extras: list[StepExtra] = field(default_factory=list)  # model features' loss terms and metrics (MoE)
    evaluators: list[Evaluator] = field(default_factory=list)  # beside the method's evaluation (the harness)


def perplexity(loss: float) -> float:
    """exp(mean token NLL); inf once it would overflow."""
    return math.exp(loss) if loss < 700 else math.inf


def per_unit(names: Iterable[str], total: Callable[[str], float], units: float) -> dict[str, float]:
    """Each method metric's sum over the step (all micro-batches, all ranks) divided by its count, or by the
    loss units when it has none."""
    out = {}
    for name in sorted(names):
        if name.endswith(COUNT):
            continue
        count = total(name + COUNT) if name + COUNT in names else units
        out[name] = total(name) / count if count else 0.0
    return out


@dataclass
class StepTotals:
    """Sums over the micro-batches of a step on this rank (loss, method metrics, the extras' values) and
    global counts."""

    loss: float
    metrics: dict[str, float]
    units: int
    target_tokens: int
    input_tokens: int
    samples: int
    attention_sq: int = 0  # sum of squared document lengths (attention's FLOPs)
    extras: dict[str, float] = field(default_factory=dict)
    micro_batches: int = 0


def _sum_tensors(values: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> None:
    for key, value in values.items():
        into[key] = into[key] + value.detach().double() if key in into else value.detach().double()


def train_step(ctx: RunContext, inputs: LoopInputs, micro_batches: list[dict[str, Any]]) -> StepTotals:
    """One optimizer step; the loss is divided by the loss units (target tokens, or pairs) of the whole step."""
    engine = inputs.engine
    keys = ("num_loss_units", "num_target_tokens", "num_input_tokens", "num_samples", "num_attention_sq")
    counts = [sum(m.get(key, 0) for m in micro_batches) for key in keys]
    units, target_tokens, input_tokens, samples, attention_sq = (
        int(x) for x in all_reduce_sum(counts, ctx.dist)
    )
    # DeepSpeed averages gradients over ranks; multiply back so the result is sum / global units.
    scale = ctx.dist.world_size / max(units, 1)
    loss_sum = torch.zeros((), device=engine.device, dtype=torch.float64)
    metric_sums: dict[str, torch.Tensor] = {}
    extra_sums: dict[str, torch.Tensor] = {}
    timers = inputs.meter.timers
    for index, micro in enumerate(micro_batches):
        with timers.section("forward"):
            batch = to_device(micro, engine.device)
            with ExitStack() as recording:
                for extra in inputs.extras:
                    recording.enter_context(extra.recording())
                loss, metrics = inputs.loss_fn(engine, batch)
            objective = loss * scale
            for extra in inputs.extras:
                term, values = extra.micro_batch(batch, len(micro_batches))
                objective = objective if term is None else objective + term
                _sum_tensors(values, extra_sums)
        engine.micro_step(objective, last=index == len(micro_batches) - 1, timers=timers)
        loss_sum += loss.detach().double()
        _sum_tensors(metrics, metric_sums)
    names, extra_names = sorted(metric_sums), sorted(extra_sums)
    stacked = [loss_sum, *(metric_sums[n] for n in names), *(extra_sums[n] for n in extra_names)]
    values = torch.stack(stacked).tolist()  # one transfer
    return StepTotals(
        values[0],
        dict(zip(names, values[1 : 1 + len(names)], strict=True)),
        units,
        target_tokens,
        input_tokens,
        samples,
        attention_sq,
        extras=dict(zip(extra_names, values[1 + len(names) :], strict=True)),
        micro_batches=len(micro_batches),
    )


@torch.no_grad()
def evaluate(ctx: RunContext, inputs: LoopInputs) -> dict[str, float]:
    """``eval_loss`` (and the method's metrics as ``eval_<name>``): means per loss unit over the whole eval
    set and all ranks."""
    engine = inputs.engine
    assert inputs.eval_loader is not None
    engine.train(False)
    if ctx.config.manual_gc and ctx.config.manual_gc_eval:
        gc.collect()
    sums: dict[str, torch.Tensor] = {}
    units = 0
    for micro in inputs.eval_loader:
        loss, metrics = inputs.loss_fn(engine, to_device(micro, engine.device))
        _sum_tensors({"loss": loss, **metrics}, sums)
        units += micro["num_loss_units"]
    engine.train(True)
    if ctx.config.manual_gc and ctx.config.manual_gc_eval:
        gc.collect()
    names = sorted(sums)
    totals = all_reduce_sum([*torch.stack([sums[n] for n in names]).tolist(), float(units)], ctx.dist)
    summed = dict(zip(names, totals, strict=False))
    means = per_unit(names, summed.__getitem__, max(totals[-1], 1.0))
    result = {f"eval_{name}": value for name, value in means.items()}
    if inputs.perplexity:
        result["eval_perplexity"] = perplexity(result["eval_loss"])
    return result


def _step_record(
    ctx: RunContext, inputs: LoopInputs, state: LoopState, totals: StepTotals, stops: list[float]
) -> tuple[dict[str, Any], list[float]]:
    """The step's metrics, reduced over the ranks in one all-reduce (with this rank's stop flags, returned
    summed): per-unit loss and method metrics, and the extras' entries."""
    config = ctx.config
    report = bool(config.loss_log_interval and state.step % config.loss_log_interval == 0)
    values = {"loss": [totals.loss], "stops": stops}
    values.update({f"metric/{name}": [value] for name, value in totals.metrics.items()})
    for extra in inputs.extras:
        values.update(extra.step_values(totals.extras, totals.micro_batches, report))
    reduced = all_reduce_named(values, ctx.dist)
    units = max(totals.units, 1)
    loss = reduced["loss"][0] / units
    record: dict[str, Any] = {"iter": state.step, "epoch": state.epoch, "loss": loss}
    if inputs.perplexity:
        record["perplexity"] = perplexity(loss)
    record.update(per_unit(totals.metrics, lambda name: reduced[f"metric/{name}"][0], units))
    for extra in inputs.extras:
        record.update(extra.metrics(reduced, report))
    return record, reduced["stops"]


def _stop_reason(ctx: RunContext, state: LoopState) -> str:
    """Exit conditions that need no agreement between ranks (every rank computes the same answer)."""
    config = ctx.config
    if config.exit_iteration and state.step >= config.exit_iteration:
        return f"exit_iteration={config.exit_iteration} reached"
    if config.exit_iteration_this_run and state.run_steps >= config.exit_iteration_this_run:
        return f"exit_iteration_this_run={config.exit_iteration_this_run} reached"
    if config.exit_interval and state.step % config.exit_interval == 0:
        return f"exit_interval={config.exit_interval} reached"
    return ""


def _after_step(ctx: RunContext, inputs: LoopInputs, state: LoopState, record: dict[str, Any]) -> None:
    """Evaluate, record, print and save as configured after an optimizer step."""
    config = ctx.config
    if config.eval_interval and state.step % config.eval_interval == 0 and inputs.eval_loader is not None:
        record.update(evaluate(ctx, inputs))
        state.evals += 1
    record.update(_evaluators(inputs, state, end=False))
    state.history.append(record)
    printed = config.loss_log_interval and state.step % config.loss_log_interval == 0
    eval_printed = (
        "eval_loss" in record
        and config.eval_log_iter_interval
        and state.evals % config.eval_log_iter_interval == 0
    )
    inputs.outputs.write(record, show=bool(printed or eval_printed))
    for checkpoint in inputs.checkpoints:
        if checkpoint.due(step=state.step):
            checkpoint.save(inputs.engine, state)


def timed(steps: Iterator[list[dict[str, Any]]], meter: StepMeter) -> Iterator[list[dict[str, Any]]]:
    """The steps' micro-batches, the wait for each counted as the step's ``data`` time."""
    while True:
        with meter.timers.section("data"):
            micro_batches = next(steps, None)
        if micro_batches is None:
            return
        yield micro_batches


def _evaluation_record(ctx: RunContext, inputs: LoopInputs, state: LoopState) -> dict[str, Any]:
    record = {"iter": state.step, "epoch": state.epoch, **evaluate(ctx, inputs), "time": time.time()}
    state.evals += 1
    inputs.outputs.write(record, show=True)
    state.history.append(record)
    return record


def initial_evaluation(ctx: RunContext, inputs: LoopInputs, state: LoopState) -> None:
    """``eval_on_start``: the held-out loss of the weights training starts from (iter 0; not on resume)."""
    if ctx.config.eval_on_start and state.step == 0 and inputs.eval_loader is not None:
        _evaluation_record(ctx, inputs, state)


def _evaluators(inputs: LoopInputs, state: LoopState, end: bool) -> dict[str, Any]:
    """The entries of the evaluators due after this step (or at the end)."""
    record: dict[str, Any] = {}
    for evaluator in inputs.evaluators:
        if evaluator.due(state.step, end):
            record.update(evaluator.evaluate(inputs.engine.module, state.step))
    return record


def final_evaluation(ctx: RunContext, inputs: LoopInputs, state: LoopState) -> dict[str, Any] | None:
    """The end-of-training (or ``skip_train``) evaluation, unless the last step just evaluated, with the
    evaluators due at the end."""
    config = ctx.config
    method = inputs.eval_loader is not None and (config.eval_at_end or config.skip_train)
    if state.history and "eval_loss" in state.history[-1]:
        method = False
    extra = _evaluators(inputs, state, end=True)
    if not method and not extra:
        return None
    record = {"iter": state.step, "epoch": state.epoch, **(evaluate(ctx, inputs) if method else {}), **extra}
    state.evals += int(method)
    record["time"] = time.time()
    inputs.outputs.write(record, show=True)
    state.history.append(record)
    return record


def train_loop(ctx: RunContext, inputs: LoopInputs, state: LoopState) -> LoopState:
    """Train from ``state`` until the epochs or ``train_iters`` are done or an exit condition fires."""
    config = ctx.config
    # from_pretrained hands the model over in eval mode: without this, dropout and activation
    # checkpointing (which transformers applies only in training mode) would be off until the first eval.
    initial_evaluation(ctx, inputs, state)
    inputs.engine.train(True)
    while state.epoch < config.epochs and not state.stop_reason and state.step < inputs.total_steps:
        for micro_batches in timed(inputs.steps.steps(state), inputs.meter):
            started = time.perf_counter()
            lr = inputs.engine.lr()  # the LR this step uses (the scheduler moves it on after the step)
            for observer in inputs.observers:
                observer.step_started(state.step + 1)
            totals = train_step(ctx, inputs, micro_batches)
            for observer in inputs.observers:
                observer.step_finished(state.step + 1)
            state.step += 1
            state.run_steps += 1
            state.epoch_step += 1
            elapsed = time.perf_counter() - started
            local_stop = inputs.stops.check(config.kill_switch_path, elapsed)
            record, stops = _step_record(ctx, inputs, state, totals, local_stop)
            record.update(
                {
                    "lr": lr,
                    "grad_norm": inputs.engine.grad_norm(),
                    "tokens": totals.target_tokens,
                    "step_time": elapsed,
                    "tokens_per_second": totals.input_tokens / elapsed if elapsed > 0 else None,
                    **inputs.meter.measure(totals.samples, totals.input_tokens, totals.attention_sq, elapsed),
                    "time": time.time(),
                }
            )
            _after_step(ctx, inputs, state, record)
            if config.manual_gc and config.manual_gc_interval and state.step % config.manual_gc_interval == 0:
                gc.collect()
            state.stop_reason = inputs.stops.reason(stops) or _stop_reason(ctx, state)
            if state.stop_reason or state.step >= inputs.total_steps:
                break
        if state.epoch_step >= len(inputs.step_plan[state.epoch]):
            state.epoch += 1
            state.epoch_step = 0
            for checkpoint in inputs.checkpoints:
                if checkpoint.due(step=state.step, epoch_end=state.epoch):
                    checkpoint.save(inputs.engine, state)
    return state
