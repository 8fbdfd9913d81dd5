"""Compose the data stages: sources -> rows -> split -> format (render + mask) -> length policy -> pack."""

from __future__ import annotations

import multiprocessing
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.config.data import DataConfig
from posttrain.context import RunContext
from posttrain.data.packing import pack_sequential
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
        samples = pack_sequential(samples, max_length)
    return samples


@dataclass(frozen=True)
class DataFactory:
    """A training method's data stages: ``format`` turns a row into token ids and labels (pure, per row);
    ``assemble`` turns the formatted samples into training sequences (length policy, packing, blocks)."""

    format: Formatter
    assemble: Callable[[list[Sample], int, DataConfig, DataReport, bool], list[Sample]] = assemble_samples


def process(
    rows: list[Row], processed: list[bool], ctx: RunContext, tokenizer: Any, max_length: int, pack: bool
) -> tuple[list[Sample], DataReport]:
    config = ctx.config.data
    report = DataReport(rows=len(rows))
    factory: DataFactory = DATA_FACTORIES.get(config.type).obj
    to_format = [row for row, flag in zip(rows, processed, strict=True) if flag]
    formatted = iter(_format_rows(to_format, factory.format, tokenizer, config))
    samples = [
        next(formatted) if flag else _preprocessed(row) for row, flag in zip(rows, processed, strict=True)
    ]
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


def _read(sources: list[Any], ctx: RunContext) -> tuple[list[Row], list[bool]]:
    rows: list[Row] = []
    flags: list[bool] = []
    for source in sources:
        loaded = load_source(source, ctx)
        rows.extend(loaded)
        flags.extend([source.process] * len(loaded))
    return rows, flags


def build_datasets(ctx: RunContext, tokenizer: Any, max_length: int) -> Datasets:
    """Train and eval samples for this run (every rank builds the same lists)."""
    config = ctx.config.data
    rows, flags = _read(config.sources, ctx)
    eval_rows, eval_flags = _read(config.eval_sources, ctx)
    held_out = config.train_eval_split[1]
    if held_out > 0:
        order = list(range(len(rows)))
        random.Random(config.seed).shuffle(order)
        n_eval = max(1, round(len(rows) * held_out))
        eval_ids, train_ids = sorted(order[:n_eval]), sorted(order[n_eval:])
        eval_rows += [rows[i] for i in eval_ids]
        eval_flags += [flags[i] for i in eval_ids]
        rows, flags = [rows[i] for i in train_ids], [flags[i] for i in train_ids]
    pack = bool(getattr(config, "pack_samples", False))
    train, train_report = process(rows, flags, ctx, tokenizer, max_length, pack)
    evaluation, eval_report = process(eval_rows, eval_flags, ctx, tokenizer, max_length, pack=False)
    if not train:
        raise DataError(f"no training samples left: {train_report.summary('train')}")
    return Datasets(train, evaluation, train_report, eval_report)
