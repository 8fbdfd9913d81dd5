"""The pre-flight report: what the data and the schedule will be, before a single step runs.

``posttrain preprocess`` builds (and caches) the data exactly as training will, then prints rows read and
dropped, token totals, the trained-token share, padding or packing efficiency, steps, two rendered samples
with the trained tokens marked, and the end-of-turn check. ``posttrain plot-lr`` draws the LR schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.data.build import DataReport, Datasets, build_datasets
from posttrain.data.cache import cache_key, cached
from posttrain.data.packing import packing_efficiency
from posttrain.data.sft import IGNORE_INDEX
from posttrain.dist import DistInfo
from posttrain.logs import get_logger, say
from posttrain.plan import BatchSizes, check_rampup, lr_explanation, resolve, step_plan
from posttrain.registry import DATA_FACTORIES, TOKENIZER_FACTORIES
from posttrain.utils.fs import atomic_write

TRAINED_START, TRAINED_END = "[[", "]]"


def load_datasets(ctx: RunContext, tokenizer: Any, max_length: int) -> Datasets:
    """Build the data, or load it from the cache when nothing that changes it has changed."""
    if not ctx.config.data.cache_enabled:
        return build_datasets(ctx, tokenizer, max_length)
    key = cache_key(ctx, tokenizer, max_length)
    data, hit = cached(ctx, key, lambda: build_datasets(ctx, tokenizer, max_length))
    if hit:
        say(f"processed data loaded from the cache ({Path(ctx.config.data.cache_dir) / key}.pkl)")
    return data


def max_length_for(config: TrainerConfig, model_config: Any) -> int:
    """``data.max_length`` as set, else the model's ``max_position_embeddings``."""
    if "max_length" in config.data.model_fields_set:
        return config.data.max_length
    found = getattr(model_config, "max_position_embeddings", None)
    if isinstance(found, int):
        get_logger().info("data.max_length not set: using the model's max_position_embeddings=%d", found)
        return found
    return config.data.max_length


def micro_batches_per_rank(samples: int, sizes: BatchSizes) -> int:
    """What ``len(DataLoader)`` is on each rank (DistributedSampler pads every rank to the same count)."""
    return math.ceil(math.ceil(samples / sizes.world_size) / sizes.micro_batch_size)


def padding_efficiency(samples: list[dict[str, list[int]]], sizes: BatchSizes, seed: int) -> float:
    """Real tokens / padded tokens over the first epoch's micro-batches, in the sampler's own order."""
    keys = [k for k in samples[0] if k.endswith("input_ids")] if samples else []
    real = padded = 0
    for rank in range(sizes.world_size):
        order = list(DistributedSampler(range(len(samples)), sizes.world_size, rank, shuffle=True, seed=seed))
        for start in range(0, len(order), sizes.micro_batch_size):
            batch = [samples[i] for i in order[start : start + sizes.micro_batch_size]]
            for key in keys:
                lengths = [len(s[key]) for s in batch]
                real += sum(lengths)
                padded += max(lengths) * len(lengths)
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


@dataclass
class Preflight:
    config: TrainerConfig
    sizes: BatchSizes
    lr: float
    data: Datasets
    tokenizer: Any
    max_length: int
    steps_per_epoch: int
    total_steps: int


def preflight(config: TrainerConfig, world_size: int) -> Preflight:
    """Resolve the batch sizes and LR for ``world_size``, build the data, and count the steps: what
    ``train`` would do before its first step, without a model or a process group."""
    from posttrain.run import pretrained_config

    resolved, sizes, lr = resolve(config, world_size)
    check_rampup(resolved.rampup_batch_size, sizes)
    ctx = RunContext(config=resolved, dist=DistInfo(0, 0, 1, torch.device("cpu")))
    Path(resolved.logger.output_dir).mkdir(parents=True, exist_ok=True)
    tokenizer = TOKENIZER_FACTORIES.get(resolved.tokenizer.type).obj(resolved.tokenizer, ctx)
    max_length = max_length_for(resolved, pretrained_config(resolved))
    data = load_datasets(ctx, tokenizer, max_length)
    per_rank = micro_batches_per_rank(len(data.train), sizes)
    plan = step_plan(per_rank, resolved.epochs, sizes, resolved.rampup_batch_size)
    total = resolved.train_iters or sum(len(steps) for steps in plan[: resolved.epochs])
    return Preflight(resolved, sizes, lr, data, tokenizer, max_length, len(plan[0]), total)


def _data_lines(report: DataReport, name: str) -> list[str]:
    return [*report.sources, report.summary(name)]


def report_text(flight: Preflight, original: TrainerConfig, color: bool = False) -> str:
    config, data, sizes = flight.config, flight.data, flight.sizes
    out = [f"pre-flight report: trainer {config.type}, world size {sizes.world_size}", "", "data"]
    out += [f"  {line}" for line in _data_lines(data.train_report, "train")]
    if data.train_report.packed:
        efficiency = packing_efficiency(data.train, flight.max_length)
        method = getattr(config.data, "packing", "")
        out.append(
            f"  packing ({method}): {efficiency:.1%} of {len(data.train)} sequences x {flight.max_length} "
            "tokens hold real tokens"
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
        out.append("  end-of-turn check: not applicable (raw text; EOS per document: data.add_eos)")
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
    legend = "bold green" if color else f"{TRAINED_START}...{TRAINED_END}"
    for index, sample in enumerate(data.train[:2], start=1):
        out += ["", f"sample {index} (trained tokens in {legend})"]
        for key in (k for k in sample if k.endswith("input_ids")):
            prefix = key[: -len("input_ids")]
            text = render_trained(flight.tokenizer, sample[key], sample[f"{prefix}labels"], color)
            out.append(f"--- {prefix.rstrip('_') or 'sequence'} ({len(sample[key])} tokens)")
            out.append(text)
    return "\n".join(out)


def lr_curve(flight: Preflight) -> tuple[list[float], list[float]]:
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


def plot_lr(flight: Preflight, out: Path) -> Path:
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
