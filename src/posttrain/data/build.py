"""Compose the data stages: sources -> rows -> split -> format (render + mask) -> length policy -> pack."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.config.data import DataConfig
from posttrain.context import RunContext
from posttrain.data.packing import pack as pack_samples
from posttrain.data.sft import IGNORE_INDEX, RowError
from posttrain.data.sources import Row, load_source
from posttrain.errors import DataError
from posttrain.registry import DATA_FACTORIES

Sample = dict[str, list[int]]
Formatter = Callable[[dict[str, Any], Any, DataConfig], Sample]
PARALLEL_MIN_ROWS = 5000


@dataclass
class DataReport:
    """What happened to the rows, for the start-of-run summary."""

    rows: int = 0
    samples: int = 0
    sequences: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    truncated: int = 0
    tokens: int = 0
    target_tokens: int = 0
    packed: bool = False
    sources: list[str] = field(default_factory=list)
    leaked: int = 0

    def summary(self, name: str) -> str:
        parts = [f"{name}: {self.rows} rows -> {self.samples} samples"]
        if self.sequences != self.samples:
            parts.append(f"packed into {self.sequences} sequences")
        for reason, count in sorted(self.dropped.items()):
            parts.append(f"{count} dropped ({reason})")
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        share = self.target_tokens / self.tokens if self.tokens else 0.0
        parts.append(f"{self.tokens} tokens, {share:.1%} trained")
        return ", ".join(parts)


@dataclass
class Datasets:
    train: list[Sample]
    eval: list[Sample]
    train_report: DataReport
    eval_report: DataReport


_WORKER_STATE: dict[str, Any] = {}


def _format_one(item: tuple[dict[str, Any], str]) -> Sample | str:
    row, origin = item
    try:
        return _WORKER_STATE["formatter"](row, _WORKER_STATE["tokenizer"], _WORKER_STATE["config"])
    except RowError as exc:
        return f"{origin}: {exc}"


def _format_rows(rows: list[Row], formatter: Formatter, tokenizer: Any, config: DataConfig) -> list[Sample]:
    _WORKER_STATE.update(formatter=formatter, tokenizer=tokenizer, config=config)
    items = [(row.data, row.origin) for row in rows]
    workers = min(config.num_proc, os.cpu_count() or 1)
    if len(items) >= PARALLEL_MIN_ROWS and workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_format_one, items, chunksize=256)
    else:
        results = [_format_one(item) for item in items]
    for result in results:
        if isinstance(result, str):
            raise DataError(result)
    return results  # type: ignore[return-value]


def _preprocessed(row: Row) -> Sample:
    try:
        return {"input_ids": list(row.data["input_ids"]), "labels": list(row.data["labels"])}
    except KeyError as exc:
        raise DataError(
            f"{row.origin}: process: false needs 'input_ids' and 'labels' (missing {exc})"
        ) from None


def apply_length_policy(
    samples: list[Sample], max_length: int, policy: str, report: DataReport
) -> list[Sample]:
    kept = []
    for sample in samples:
        if len(sample["input_ids"]) > max_length:
            if policy == "drop":
                report.dropped[f"longer than max_length={max_length}"] += 1
                continue
            sample = {key: value[:max_length] for key, value in sample.items()}
            report.truncated += 1
        if all(label == IGNORE_INDEX for label in sample["labels"][1:]):
            report.dropped["no trained tokens"] += 1
            continue
        kept.append(sample)
    return kept


def assemble_samples(
    samples: list[Sample], max_length: int, config: DataConfig, report: DataReport, pack: bool
) -> list[Sample]:
    """One sample per sequence (over-long ones dropped or truncated), or packed several per sequence."""
    samples = apply_length_policy(samples, max_length, getattr(config, "overlong_samples", "drop"), report)
    report.samples = len(samples)
    if pack:
        random.Random(config.seed).shuffle(samples)
        samples = pack_samples(samples, max_length, getattr(config, "packing", "best-fit"))
    return samples


@dataclass(frozen=True)
class DataFactory:
    """A training method's data stages: ``format`` turns a row into token ids and labels (pure, per row);
    ``assemble`` turns the formatted samples into training sequences (length policy, packing, blocks);
    ``chat``: rows are conversations (the end-of-turn check applies)."""

    format: Formatter
    assemble: Callable[[list[Sample], int, DataConfig, DataReport, bool], list[Sample]] = assemble_samples
    chat: bool = True


def process(
    rows: list[Row], ctx: RunContext, tokenizer: Any, max_length: int, pack: bool
) -> tuple[list[Sample], DataReport]:
    config = ctx.config.data
    report = DataReport(rows=len(rows), packed=pack)
    factory: DataFactory = DATA_FACTORIES.get(config.type).obj
    formatted = iter(_format_rows([row for row in rows if row.process], factory.format, tokenizer, config))
    samples = [next(formatted) if row.process else _preprocessed(row) for row in rows]
    samples = factory.assemble(samples, max_length, config, report, pack)
    report.sequences = len(samples)
    report.tokens = sum(len(v) for s in samples for k, v in s.items() if k.endswith("input_ids"))
    report.target_tokens = sum(
        sum(1 for x in v[1:] if x != IGNORE_INDEX)
        for s in samples
        for k, v in s.items()
        if k.endswith("labels")
    )
    return samples, report


def weighted_mix(parts: list[list[Any]], weights: list[float], seed: int) -> list[Any]:
    """SiloGen's precomputed weighted mix: draw a part with probability proportional to its weight and take
    its next item (cycling), until every part with a positive weight has been used up at least once.
    Weight 0 drops a part."""
    rng = random.Random(seed)
    active = [i for i, (part, weight) in enumerate(zip(parts, weights, strict=True)) if weight > 0 and part]
    chosen_weights = [weights[i] for i in active]
    taken = dict.fromkeys(active, 0)
    unfinished = set(active)
    mixed = []
    while unfinished:
        index = rng.choices(active, weights=chosen_weights)[0]
        part = parts[index]
        mixed.append(part[taken[index] % len(part)])
        taken[index] += 1
        if taken[index] >= len(part):
            unfinished.discard(index)
    return mixed


def split_rows(rows: list[Any], held_out: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, eval): a seeded random ``held_out`` share of the rows (at least one) for evaluation, both in
    their original order."""
    if held_out <= 0 or not rows:
        return rows, []
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * held_out))
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def _content(row: Row) -> str:
    return json.dumps(row.data, sort_keys=True, default=str)


def _read(config: DataConfig, ctx: RunContext, report: DataReport) -> tuple[list[Row], list[Row]]:
    """Training and eval rows: each source is read and sampled, its eval share split off, and only then
    are the training shares concatenated or mixed (so oversampling never copies a row into both sets)."""
    split_seed = config.seed if config.split_seed is None else config.split_seed
    parts, weights, held = [], [], []
    for source in config.sources:
        rows = [Row(r.data, r.origin, source.process) for r in load_source(source, ctx)]
        train, evaluation = split_rows(rows, config.train_eval_split[1], split_seed)
        parts.append(train)
        weights.append(source.sampling_weight)
        held.extend(evaluation)
        share = f", weight {source.sampling_weight:g}" if config.mix == "weighted" else ""
        report.sources.append(
            f"{source.name_or_path}: {len(rows)} rows read, {len(train)} for training, "
            f"{len(evaluation)} held out{share}"
        )
    if config.mix == "weighted":
        train = weighted_mix(parts, weights, config.mix_seed)
        distinct = sum(len(p) for p, w in zip(parts, weights, strict=True) if w > 0)
        report.sources.append(f"weighted mix: {len(train)} training rows drawn from {distinct} distinct rows")
    else:
        train = [row for part in parts for row in part]
    for source in config.eval_sources:
        rows = [Row(r.data, r.origin, source.process) for r in load_source(source, ctx)]
        held.extend(rows)
        report.sources.append(f"{source.name_or_path}: {len(rows)} rows read for evaluation")
    seen = {_content(row) for row in train}
    report.leaked = sum(1 for row in held if _content(row) in seen)
    return train, held


def build_datasets(ctx: RunContext, tokenizer: Any, max_length: int) -> Datasets:
    """Train and eval samples for this run (every rank builds the same lists)."""
    config = ctx.config.data
    read = DataReport()
    rows, eval_rows = _read(config, ctx, read)
    pack = bool(getattr(config, "pack_samples", False))
    train, train_report = process(rows, ctx, tokenizer, max_length, pack)
    evaluation, eval_report = process(eval_rows, ctx, tokenizer, max_length, pack=False)
    train_report.sources, train_report.leaked = read.sources, read.leaked
    if not train:
        raise DataError(f"no training samples left: {train_report.summary('train')}")
    return Datasets(train, evaluation, train_report, eval_report)
