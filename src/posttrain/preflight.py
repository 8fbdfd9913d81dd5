"""The pre-flight report: what the data and the schedule will be, before a single step runs.

``posttrain preprocess`` builds (and caches) the data exactly as training will, then prints rows read and
dropped, token totals, the trained-token share, padding or packing efficiency, steps, two rendered samples
with the trained tokens marked, and the end-of-turn check. ``posttrain plot-lr`` draws the LR schedule.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.data.build import DataReport
from posttrain.data.packing import packing_efficiency
from posttrain.data.sampler import shard_order
from posttrain.data.samples import IGNORE_INDEX
from posttrain.data.views import View
from posttrain.dist import DistInfo
from posttrain.memory.check import memory_plan
from posttrain.memory.machine import Machine
from posttrain.memory.report import plan_as_data, plan_text
from posttrain.memory.shape import ShapeUnavailable, model_shape
from posttrain.models.fp8 import emulation_reason, run_device
from posttrain.plan import BatchSizes, DataPlan, lr_explanation, resolve
from posttrain.registry import DATA_FACTORIES, TOKENIZER_FACTORIES, TRAINERS, load_component
from posttrain.stages.data import model_facts, plan_data
from posttrain.utils.fs import atomic_write

TRAINED_START, TRAINED_END = "[[", "]]"


def padding_efficiency(view: View, sizes: BatchSizes, seed: int) -> float:
    """Real tokens / padded tokens over the first epoch's micro-batches, in the sampler's own order."""
    real = padded = 0
    for column in view.input_columns:
        lengths = view.lengths(column)
        for rank in range(sizes.world_size):
            order = shard_order(len(lengths), sizes.world_size, rank, seed, epoch=0)
            batched = lengths[order]
            starts = np.arange(0, len(batched), sizes.micro_batch_size)
            if len(starts) == 0:
                continue
            real += int(batched.sum())
            longest = np.maximum.reduceat(batched, starts)
            counts = np.diff(np.append(starts, len(batched)))
            padded += int((longest * counts).sum())
    return real / padded if padded else 0.0


def render_trained(tokenizer: Any, ids: list[int], labels: list[int], color: bool) -> str:
    """The sample's text with trained tokens (labels != -100, the first position excluded) marked."""
    start, end = ("\033[1;32m", "\033[0m") if color else (TRAINED_START, TRAINED_END)
    pieces, run, trained = [], [], None
    for position, (token, label) in enumerate(zip(ids, labels, strict=True)):
        now = position > 0 and label != IGNORE_INDEX
        if now != trained and run:
            text = tokenizer.decode(run)
            pieces.append(f"{start}{text}{end}" if trained else text)
            run = []
        trained = now
        run.append(token)
    if run:
        text = tokenizer.decode(run)
        pieces.append(f"{start}{text}{end}" if trained else text)
    return "".join(pieces)


Preflight = DataPlan


def preflight(config: TrainerConfig, world_size: int) -> DataPlan:
    """Resolve the batch sizes and LR for ``world_size``, build the data, and count the steps: what
    ``train`` does before its first step (the same data plan), without a model or a process group."""
    resolved, sizes, lr = resolve(config, world_size)
    ctx = RunContext(config=resolved, dist=DistInfo(0, 0, 1, torch.device("cpu")))
    Path(resolved.logger.output_dir).mkdir(parents=True, exist_ok=True)
    tokenizer = TOKENIZER_FACTORIES.get(resolved.tokenizer.type).obj(resolved.tokenizer, ctx)
    return plan_data(ctx, sizes, lr, tokenizer, model_facts(resolved))


def _data_lines(report: DataReport, name: str) -> list[str]:
    return [*report.sources, report.summary(name)]


def truncated_answers(config: TrainerConfig, report: DataReport) -> int:
    """Samples whose end was cut (``overlong_samples: truncate``): their last answer lost its end-of-turn
    token, which the end-of-turn check (run before the cut) cannot see."""
    return report.truncated if config.data.overlong_samples == "truncate" else 0


def report_text(flight: DataPlan, original: TrainerConfig, color: bool = False) -> str:
    config, data, sizes = flight.config, flight.data, flight.sizes
    out = [f"pre-flight report: trainer {config.type}, world size {sizes.world_size}", "", "data"]
    out += [f"  {line}" for line in _data_lines(data.train_report, "train")]
    if data.train_report.packed:
        efficiency = packing_efficiency(data.train, flight.max_length)
        method = config.data.packing
        out.append(
            f"  packing ({method}): {efficiency:.1%} of {len(data.train)} sequences x {flight.max_length} "
            "tokens hold real tokens"
        )
    elif config.data.padding_free:
        out.append(
            f"  padding-free: each micro-batch's {sizes.micro_batch_size} samples are joined into one row "
            "(every token is real; documents attend apart)"
        )
    else:
        efficiency = padding_efficiency(data.train, sizes, config.data.seed)
        out.append(
            f"  padding: {efficiency:.1%} of the tokens in padded micro-batches of {sizes.micro_batch_size} "
            "are real (first epoch, sampler order)"
        )
    if data.eval:
        out += [f"  {line}" for line in _data_lines(data.eval_report, "eval")]
    leak = data.train_report.leaked
    out.append(f"  eval rows identical to a training row: {leak}" + ("  <-- WARNING" if leak else ""))
    factory = DATA_FACTORIES.get(config.data.type).obj
    if not factory.chat:
        out.append(f"  end-of-turn check: not applicable ({factory.not_chat})")
    elif config.data.check_end_of_turn and truncated_answers(config, data.train_report):
        out.append(
            "  end-of-turn check: passed before truncation; the last answer of the "
            f"{data.train_report.truncated} truncated samples lost its end-of-turn token (raise data.max_length, "
            "or data.overlong_samples: drop)"
        )
    elif config.data.check_end_of_turn:
        out.append("  end-of-turn check: passed (every assistant turn ends with a trained end-of-turn token)")
    else:
        out.append("  end-of-turn check: OFF (data.check_end_of_turn: false)")
    out += ["", "schedule"]
    out.append(
        f"  global batch {sizes.global_batch_size} = micro-batch {sizes.micro_batch_size} x accumulation "
        f"{sizes.gradient_accumulation_steps} x {sizes.world_size} processes"
    )
    out.append(f"  {lr_explanation(original, sizes, flight.lr)}")
    limit = f" (train_iters={config.train_iters})" if config.train_iters else ""
    out.append(f"  steps: {flight.steps_per_epoch} per epoch, {flight.total_steps} in total{limit}")
    if config.model.fp8 is not None:
        out += ["", "precision", f"  {fp8_line(config)}"]
    spec = TRAINERS.get(config.type).obj
    if spec.report:
        out += [f"  {line}" for line in load_component(spec.report)(flight)]
    legend = "bold green" if color else f"{TRAINED_START}...{TRAINED_END}"
    for index, sample in enumerate((data.train[i] for i in range(min(2, len(data.train)))), start=1):
        out += ["", f"sample {index} ({factory.parts.get('', 'trained tokens')} in {legend})"]
        for key in (k for k in sample if k.endswith("input_ids")):
            prefix = key[: -len("input_ids")]
            ids = np.asarray(sample[key]).tolist()
            if not ids:  # a KTO row's absent kind
                continue
            labels = sample.get(f"{prefix}labels")
            if labels is None:  # a prompt: what is trained is sampled from it while training
                out.append(f"--- prompt ({len(ids)} tokens; its completions are sampled while training)")
                out.append(flight.tokenizer.decode(ids))
                continue
            text = render_trained(flight.tokenizer, ids, np.asarray(labels).tolist(), color)
            name = prefix.rstrip("_") or "sequence"
            out.append(f"--- {factory.parts.get(prefix, name)} ({len(ids)} tokens)")
            out.append(text)
    return "\n".join(out)


def fp8_line(config: TrainerConfig) -> str:
    """What ``model.fp8`` converts (the layers chosen on the model built on the meta device, as the run will
    choose them) and whether this machine runs it on FP8 matrix units or emulates it."""
    recipe = config.model.fp8
    try:
        shape = model_shape(config.model)
    except ShapeUnavailable as error:
        return f"fp8 {recipe}: the layers are known once the model loads ({error})"
    assert shape.fp8 is not None
    dtype = shape.dtype if config.model.dtype == "auto" else config.model.dtype
    why = emulation_reason(recipe, run_device())
    where = f"emulated here ({why})" if why else "on this machine's FP8 matrix units"
    return f"{shape.fp8.summary(recipe, dtype)}; {where}"


def longest_row(flight: DataPlan) -> int:
    """The most tokens a row of a micro-batch can hold: the sequence length for packed rows, else the
    longest training sample (a padded micro-batch is as long as its longest sample)."""
    data = flight.data
    if data.train_report.packed or flight.config.data.padding_free or not len(data.train):
        return flight.max_length
    view = data.train
    return max(int(np.max(view.lengths(column))) for column in view.input_columns)


def most_image_tokens(flight: DataPlan) -> int:
    """The most image tokens a row of a micro-batch can hold (a vision-language run's data; 0 otherwise): a
    sample's own for padded rows (each of a pair's rows reads its images), and for rows of several samples
    the row's length at the densest sample's share of image tokens (no row is denser than its densest)."""
    report, config = flight.data.train_report, flight.config
    if not report.image_tokens:
        return 0
    if report.packed or config.data.padding_free:
        return math.ceil(longest_row(flight) * report.image_share)
    rows = TRAINERS.get(config.type).obj.rows_per_sample
    return math.ceil(report.most_image_tokens / rows)


def memory_report(flight: DataPlan, machine: Machine) -> tuple[str, dict[str, Any] | None]:
    """The memory plan of the pre-flight's config, for rows as long as the data's longest, as text and
    data; a model factory that reports no config before loading gets a line saying so."""
    config = flight.config
    if model_facts(config) is None:
        return f"memory plan: not available (model.type {config.model.type!r} reports no config)", None
    world = flight.sizes.world_size * config.sequence_parallel_size
    try:
        memory = memory_plan(config, world, machine, longest_row(flight), most_image_tokens(flight))
    except ShapeUnavailable as error:
        return f"memory plan: not available (the model cannot be built on the meta device: {error})", None
    return plan_text(memory, machine), plan_as_data(memory, machine)


def lr_curve(flight: DataPlan) -> tuple[list[float], list[float]]:
    """LR and weight decay at every step of the run, from the configured scheduler on a stand-in model."""
    from posttrain.optim.adamw import param_groups
    from posttrain.registry import SCHEDULERS

    config = flight.config
    model = torch.nn.Linear(1, 1, bias=False)
    groups = param_groups(model, config.optimizer.weight_decay, flight.lr)
    optimizer = torch.optim.AdamW(groups, lr=flight.lr, weight_decay=config.optimizer.weight_decay)
    ctx = RunContext(config=config, dist=DistInfo(0, 0, 1, torch.device("cpu")))
    scheduler = SCHEDULERS.get(config.scheduler.type).obj(
        config.scheduler, optimizer, flight.total_steps, ctx
    )
    lrs, decays = [], []
    for _ in range(flight.total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        decays.append(optimizer.param_groups[0]["weight_decay"])
        optimizer.step()
        scheduler.step()
    return lrs, decays


def plot_lr(flight: DataPlan, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs, decays = lr_curve(flight)
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.plot(range(1, len(lrs) + 1), lrs, color="tab:blue")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("learning rate", color="tab:blue")
    scheduler = flight.config.scheduler
    axis.set_title(
        f"scheduler {scheduler.type}: {getattr(scheduler, 'lr_decay_style', getattr(scheduler, 'name', ''))}"
    )
    if len(set(decays)) > 1:
        twin = axis.twinx()
        twin.plot(range(1, len(decays) + 1), decays, color="tab:orange")
        twin.set_ylabel("weight decay", color="tab:orange")
    figure.tight_layout()
    try:
        return atomic_write(out, lambda tmp: figure.savefig(tmp, dpi=100))
    finally:
        plt.close(figure)
