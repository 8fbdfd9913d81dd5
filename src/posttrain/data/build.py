"""Compose the data stages into an on-disk store and the views that train and evaluate from it.

sources (read in bounded chunks; sampling and the train/eval split drawn on row numbers)
-> the method's batch formatter and length policy, over ``data.num_proc`` processes, chunk by chunk
-> the sample store (token ids written once, memory-mapped by every reader)
-> the training mix (concatenated or weighted, on sample ids) -> the method's assembly (views: one sample
per sequence, packed spans, or fixed blocks).

Only per-row and per-sample numbers (ids, lengths, 8-byte row hashes for the eval-leak check) are held in
memory while building; tokens go straight to disk.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.config.data import DataConfig
from posttrain.context import RunContext
from posttrain.data.mixing import held_out_mask, weighted_mix_ids
from posttrain.data.packing import pack_bins
from posttrain.data.progress import BuildProgress
from posttrain.data.samples import RowError, Sample, trained_tokens
from posttrain.data.sources import CHUNK_ROWS, Row, open_source, sample_rows
from posttrain.data.store import SampleStore, StoreWriter
from posttrain.data.views import PackedView, SampleView, View
from posttrain.errors import DataError
from posttrain.registry import DATA_FACTORIES

BatchFormatter = Callable[[list[dict[str, Any]], Any, DataConfig], list["Sample | RowError"]]
#: the length policy for one formatted sample: (the sample to keep or None, why it was dropped, truncated?)
Fitter = Callable[[Sample, int, DataConfig], tuple["Sample | None", str, bool]]
Assembler = Callable[[SampleStore, np.ndarray, int, DataConfig, bool], View]
PARALLEL_MIN_ROWS = 5000
#: written last into a store directory: its presence means the store is complete
REPORTS = "reports.json"


@dataclass
class DataReport:
    """What happened to the rows, for the start-of-run summary (saved with the store)."""

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
    images: int = 0  # a vision-language run: images in the stored samples
    image_tokens: int = 0  # and the positions their features take
    most_image_tokens: int = 0  # in one sample (a pair's rows each count theirs)
    image_share: float = 0.0  # the largest share of a sample's tokens that are image tokens

    def summary(self, name: str) -> str:
        parts = [f"{name}: {self.rows} rows -> {self.samples} samples"]
        if self.sequences != self.samples:
            parts.append(f"packed into {self.sequences} sequences")
        for reason, count in sorted(self.dropped.items()):
            parts.append(f"{count} dropped ({reason})")
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        if self.target_tokens:
            parts.append(f"{self.tokens} tokens, {self.target_tokens / self.tokens:.1%} trained")
        else:  # prompts (grpo): what is trained is sampled while training
            parts.append(f"{self.tokens} tokens")
        if self.images:
            parts.append(f"{self.images} images ({self.image_tokens} image tokens)")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "dropped": dict(self.dropped)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> DataReport:
        return cls(**{**value, "dropped": Counter(value["dropped"])})


def count_images(report: DataReport, images: np.ndarray, tokens: np.ndarray) -> None:
    """Add kept samples' ``images`` (per sample: images, image tokens) of ``tokens`` tokens to ``report``."""
    if not len(images):
        return
    report.images += int(images[:, 0].sum())
    report.image_tokens += int(images[:, 1].sum())
    report.most_image_tokens = max(report.most_image_tokens, int(images[:, 1].max()))
    share = float((images[:, 1] / np.maximum(tokens, 1)).max())
    report.image_share = max(report.image_share, share)


@dataclass
class Datasets:
    train: View
    eval: View
    train_report: DataReport
    eval_report: DataReport


def fit_sample(sample: Sample, max_length: int, config: DataConfig) -> tuple[Sample | None, str, bool]:
    """Drop or truncate a sample longer than ``max_length``; drop one with nothing (left) to train."""
    truncated = False
    if len(sample["input_ids"]) > max_length:
        if config.overlong_samples == "drop":
            return None, f"longer than max_length={max_length}", False
        sample = {key: value[:max_length] for key, value in sample.items()}
        truncated = True
    if not trained_tokens(sample["labels"]):
        return None, "no trained tokens", truncated
    return sample, "", truncated


def assemble_samples(
    store: SampleStore, samples: np.ndarray, max_length: int, config: DataConfig, pack: bool
) -> View:
    """One sample per sequence, or (``pack``) shuffled with ``data.seed`` and packed per ``data.packing``."""
    if not pack:
        return SampleView(store, samples)
    shuffled = samples[np.random.default_rng(config.seed).permutation(len(samples))]
    lengths = store.lengths("input_ids")[shuffled]
    offsets, members = pack_bins(lengths, max_length, config.packing)
    return PackedView(store, (shuffled, np.zeros_like(shuffled), lengths), offsets, members)


@dataclass(frozen=True)
class DataFactory:
    """A training method's data stages: ``format_batch`` turns rows into samples (pure); ``fit`` applies the
    length policy to one sample; ``assemble`` turns stored sample ids into training sequences; ``columns``
    are the sample's token columns; ``chat``: rows are conversations (the end-of-turn check applies)."""

    format_batch: BatchFormatter
    columns: tuple[str, ...] = ("input_ids", "labels")
    fit: Fitter = fit_sample
    assemble: Assembler = assemble_samples
    chat: bool = True
    not_chat: str = ""
    """Why the end-of-turn check does not apply (the pre-flight report's line, for ``chat: False``)."""
    origin_key: str = ""
    """When set, each row reaches ``format_batch`` with its place (``file row N``) under this key (a
    method that keeps rows for later, grpo's rewards, reports a failure with it)."""
    parts: dict[str, str] = field(default_factory=dict)
    """What each sequence of a sample is (by its columns' prefix, ``chosen_``...), for the pre-flight
    report's samples: which answer is preferred, which completion desirable, what is only scored."""
    revision: int = 1
    """Raised when ``format_batch`` turns the same rows into other tokens, so that stores built before are
    not reused (part of the data cache's key)."""
    measure: Callable[[Sample], tuple[int, int]] | None = None
    """A kept sample's images and image tokens, for the reports (a vision-language run)."""


def data_factory(config: DataConfig, tokenizer: Any) -> DataFactory:
    """The run's data stages: the method's data factory, read for images when the model reads them."""
    from posttrain.vision.data import with_images

    return with_images(DATA_FACTORIES.get(config.type).obj, config.type, tokenizer)


# --------------------------------------------------------------------------------------- formatting workers

_WORKER: dict[str, Any] = {}


@dataclass
class Chunk:
    """One chunk's formatted output: concatenated columns and per-sample lengths of the kept samples."""

    flat: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    held_out: np.ndarray  # per kept sample
    row_hashes: np.ndarray  # per row read
    row_held_out: np.ndarray  # per row read
    dropped: Counter[str]
    truncated: int
    errors: list[str] = field(default_factory=list)  # bad rows, "file:row: what is wrong"
    images: np.ndarray | None = None  # per kept sample: (images, image tokens)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):  # token arrays (Megatron documents): hash their bytes
        return hashlib.blake2b(np.ascontiguousarray(value).tobytes(), digest_size=16).hexdigest()
    return str(value)


def row_hash(data: dict[str, Any]) -> int:
    """An 8-byte content hash of a row (the eval-leak check compares these, not the rows)."""
    text = json.dumps(data, sort_keys=True, default=_plain).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _preprocessed(data: dict[str, Any], origin: str) -> Sample:
    try:
        return {
            "input_ids": np.asarray(data["input_ids"], dtype=np.int64),
            "labels": np.asarray(data["labels"], dtype=np.int64),
        }
    except KeyError as exc:
        raise DataError(f"{origin}: process: false needs 'input_ids' and 'labels' (missing {exc})") from None


#: bad rows reported at once; the build stops reading at this many
MAX_ROW_ERRORS = 20


def bad_rows_message(bad: list[str]) -> str:
    if len(bad) == 1:
        return bad[0]
    shown = bad[:MAX_ROW_ERRORS]
    more = " (the build stopped reading there: there may be more)" if len(bad) >= MAX_ROW_ERRORS else ""
    return f"{len(shown)} bad rows{more}:\n  " + "\n  ".join(shown)


def format_chunk(rows: list[Row], held_out: np.ndarray, process: bool) -> Chunk:
    """Format one chunk of a source's rows (``process``: run the method's formatter; else the rows already
    hold ``input_ids`` and ``labels``) and apply the length policy."""
    factory: DataFactory = _WORKER["factory"]
    config, tokenizer, max_length = _WORKER["config"], _WORKER["tokenizer"], _WORKER["max_length"]
    hashes = np.array([row_hash(row.data) for row in rows], dtype=np.uint64)
    readable = [
        {**row.data, factory.origin_key: row.origin} if factory.origin_key else row.data
        for row in rows
        if not row.error
    ]
    formatted = iter(factory.format_batch(readable, tokenizer, config) if process else [])
    kept: list[Sample] = []
    kept_held: list[bool] = []
    dropped: Counter[str] = Counter()
    truncated = 0
    errors: list[str] = []
    for row, held in zip(rows, held_out.tolist(), strict=True):
        if row.error:
            errors.append(f"{row.origin}: {row.error}")
            continue
        try:
            sample = next(formatted) if process else _preprocessed(row.data, row.origin)
        except DataError as exc:
            errors.append(str(exc))
            continue
        if isinstance(sample, RowError):
            errors.append(f"{row.origin}: {sample}")
            continue
        if errors:
            continue  # the build will stop: only the bad rows matter now
        fitted, reason, cut = factory.fit(sample, max_length, config)
        truncated += cut
        if fitted is None:
            dropped[reason] += 1
            continue
        kept.append(fitted)
        kept_held.append(held)
    flat = {
        c: np.concatenate([s[c] for s in kept]) if kept else np.zeros(0, np.int64) for c in factory.columns
    }
    lengths = {c: np.array([len(s[c]) for s in kept], dtype=np.int64) for c in factory.columns}
    measured = (
        np.array([factory.measure(s) for s in kept], np.int64).reshape(-1, 2) if factory.measure else None
    )
    held = np.array(kept_held, dtype=bool)
    return Chunk(flat, lengths, held, hashes, held_out, dropped, truncated, errors, images=measured)


@dataclass
class Task:
    """One chunk of a source: its rows (read by the main process), or the row numbers of a source that the
    formatting process reads itself (random access: the main process then only writes the results)."""

    held_out: np.ndarray
    process: bool
    rows: list[Row] | None = None
    source: int = -1
    numbers: np.ndarray | None = None


def _format_task(task: Task) -> Chunk:
    rows = task.rows if task.rows is not None else _WORKER["readers"][task.source].read(task.numbers)
    return format_chunk(rows, task.held_out, task.process)


class Formatter:
    """Formats chunks in order, in this process or in a pool of ``workers`` forked processes, keeping at
    most two chunks per worker in flight (memory stays bounded whatever the data size)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None

    def map(self, tasks: Iterator[Task]) -> Iterator[Chunk]:
        if self.pool is None:
            yield from (_format_task(task) for task in tasks)
            return
        pending: list[Any] = []
        for task in tasks:
            pending.append(self.pool.apply_async(_format_task, (task,)))
            if len(pending) >= 2 * self.workers:
                yield pending.pop(0).get()
        while pending:
            yield pending.pop(0).get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


# ------------------------------------------------------------------------------------------------ build


@dataclass
class _Planned:
    """A source to read: its reader, the row numbers kept by sampling, and which of them are held out."""

    name: str
    reader: Any
    wanted: np.ndarray | None
    held_out: np.ndarray
    process: bool
    train_source: bool
    weight: float = 1.0


def _plan_sources(config: DataConfig, ctx: RunContext) -> list[_Planned]:
    split_seed = config.seed if config.split_seed is None else config.split_seed
    planned = []
    for source in config.sources:
        reader = open_source(source, ctx)
        wanted = sample_rows(len(reader), source)
        count = len(reader) if wanted is None else len(wanted)
        held = held_out_mask(count, config.train_eval_split[1], split_seed)
        planned.append(
            _Planned(source.name_or_path, reader, wanted, held, source.process, True, source.sampling_weight)
        )
    for source in config.eval_sources:
        reader = open_source(source, ctx)
        wanted = sample_rows(len(reader), source)
        count = len(reader) if wanted is None else len(wanted)
        planned.append(
            _Planned(source.name_or_path, reader, wanted, np.ones(count, bool), source.process, False)
        )
    return planned


def _tasks(number: int, planned: _Planned, chunk_rows: int) -> Iterator[Task]:
    """Chunks of a source: row numbers for a worker to read itself when the reader allows it, else rows."""
    count = len(planned.held_out)
    if hasattr(planned.reader, "read"):
        for start in range(0, count, chunk_rows):
            stop = min(start + chunk_rows, count)
            numbers = np.arange(start, stop) if planned.wanted is None else planned.wanted[start:stop]
            yield Task(planned.held_out[start:stop], planned.process, source=number, numbers=numbers)
        return
    rows = planned.reader.rows(planned.wanted)
    for start in range(0, count, chunk_rows):
        chunk = list(itertools.islice(rows, chunk_rows))
        yield Task(planned.held_out[start : start + len(chunk)], planned.process, rows=chunk)


def _workers(config: DataConfig, rows: int) -> int:
    if rows < PARALLEL_MIN_ROWS:
        return 1
    return max(1, min(config.num_proc, os.cpu_count() or 1))


def build_store(ctx: RunContext, tokenizer: Any, max_length: int, directory: Path, show: bool = True) -> None:
    """Read, format and write every source's rows into a store at ``directory`` (written in place: the
    caller builds in a temporary directory and renames it). The reports and the train/eval sample ids are
    saved beside the tokens."""
    config = ctx.config.data
    factory = data_factory(config, tokenizer)
    planned = _plan_sources(config, ctx)
    total = sum(len(p.held_out) for p in planned)
    workers = _workers(config, total)
    chunk_rows = CHUNK_ROWS if workers == 1 else max(16, min(CHUNK_ROWS, -(-total // (workers * 8))))
    readers = [p.reader for p in planned]
    _WORKER.update(
        factory=factory, config=config, tokenizer=tokenizer, max_length=max_length, readers=readers
    )
    writer = StoreWriter(directory, factory.columns)
    train_report, eval_report = DataReport(), DataReport()
    parts: list[np.ndarray] = []
    held: list[np.ndarray] = []
    train_hashes: list[np.ndarray] = []
    eval_hashes: list[np.ndarray] = []
    progress = BuildProgress(total, enabled=show)
    formatter = Formatter(workers)
    bad: list[str] = []
    try:
        for number, source in enumerate(planned):
            ids_train, ids_held = [], []
            for chunk in formatter.map(_tasks(number, source, chunk_rows)):
                bad += chunk.errors
                if len(bad) >= MAX_ROW_ERRORS:
                    break
                if bad:
                    continue  # keep reading for more bad rows; nothing more is written
                ids = writer.append(chunk.flat, chunk.lengths)
                ids_train.append(ids[~chunk.held_out])
                ids_held.append(ids[chunk.held_out])
                train_hashes.append(chunk.row_hashes[~chunk.row_held_out])
                eval_hashes.append(chunk.row_hashes[chunk.row_held_out])
                report = train_report if source.train_source else eval_report
                rows_train = int((~chunk.row_held_out).sum())
                train_report.rows += rows_train
                eval_report.rows += len(chunk.row_held_out) - rows_train
                report.dropped.update(chunk.dropped)
                report.truncated += chunk.truncated
                if chunk.images is not None:
                    tokens = sum(v for k, v in chunk.lengths.items() if k.endswith("input_ids"))
                    for part, where in ((train_report, ~chunk.held_out), (eval_report, chunk.held_out)):
                        count_images(part, chunk.images[where], np.asarray(tokens)[where])
                progress.advance(len(chunk.row_hashes))
            if len(bad) >= MAX_ROW_ERRORS:
                break
            if source.train_source:
                parts.append(_cat(ids_train))
            held.append(_cat(ids_held))
            _describe(source, config, train_report)
    finally:
        formatter.close()
        progress.close()
        _WORKER.clear()
    if bad:
        raise DataError(bad_rows_message(bad))
    train_ids = _mix(config, parts, train_report)
    eval_ids = _cat(held)
    train_report.leaked = int(np.isin(_cat(eval_hashes), _cat(train_hashes)).sum())
    writer.close()
    _assemble(factory, config, directory, max_length, train_ids, eval_ids, train_report, eval_report)


def _assemble(
    factory: DataFactory,
    config: DataConfig,
    directory: Path,
    max_length: int,
    train_ids: np.ndarray,
    eval_ids: np.ndarray,
    train_report: DataReport,
    eval_report: DataReport,
) -> None:
    """Assemble the training and eval sequences once (packing included), save their index arrays and the
    final reports beside the tokens."""
    store = SampleStore(directory)
    pack = config.pack_samples
    for name, ids, report, packed in (
        ("train", train_ids, train_report, pack),
        ("eval", eval_ids, eval_report, False),
    ):
        view = factory.assemble(store, ids, max_length, config, packed)
        report.packed = packed
        report.samples = len(ids)
        report.sequences = len(view)
        report.tokens = int(sum(view.lengths(c).sum() for c in view.input_columns)) if len(view) else 0
        report.target_tokens = view.trained_tokens() if len(view) else 0
        view.save(directory, name)
    reports = {"train_report": train_report.to_json(), "eval_report": eval_report.to_json()}
    (directory / REPORTS).write_text(json.dumps(reports, indent=1))


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _describe(source: _Planned, config: DataConfig, report: DataReport) -> None:
    read = len(source.held_out)
    if not source.train_source:
        report.sources.append(f"{source.name}: {read} rows read for evaluation")
        return
    held = int(source.held_out.sum())
    share = f", weight {source.weight:g}" if config.mix == "weighted" else ""
    report.sources.append(
        f"{source.name}: {read} rows read, {read - held} for training, {held} held out{share}"
    )


def _mix(config: DataConfig, parts: list[np.ndarray], report: DataReport) -> np.ndarray:
    if config.mix != "weighted":
        return _cat(parts)
    weights = [s.sampling_weight for s in config.sources]
    mixed = weighted_mix_ids(parts, weights, config.mix_seed)
    distinct = sum(len(p) for p, w in zip(parts, weights, strict=True) if w > 0)
    report.sources.append(
        f"weighted mix: {len(mixed)} training samples drawn from {distinct} distinct samples"
    )
    return mixed


def open_datasets(directory: Path) -> Datasets:
    """The train and eval views of a built store: a few small files are read, the rest is memory-mapped."""
    store = SampleStore(directory)
    reports = json.loads((directory / REPORTS).read_text())
    train_report = DataReport.from_json(reports["train_report"])
    train = View.restore(store, directory, "train")
    if len(train) == 0:
        raise DataError(f"no training samples left: {train_report.summary('train')}")
    evaluation = View.restore(store, directory, "eval")
    return Datasets(train, evaluation, train_report, DataReport.from_json(reports["eval_report"]))
