"""The on-disk sample store: processed token ids written once, memory-mapped read-only by every reader.

A store is a directory. Each ragged column (``input_ids``, ``labels``, DPO's ``chosen_input_ids``...) is a
flat ``<column>.bin`` of int32 tokens (raw bytes for a ``*_json`` column: a grpo prompt's row) plus ``<column>.idx.npy`` (int64 offsets, one more than the samples),
the layout of Megatron's ``.bin/.idx`` files. Per-sample statistics (``<column>.trained.npy``: labels that
are predicted, the first one excluded) let reports and packing work on arrays without reading tokens.

The operating system maps the files once per node: every rank and data-loader worker shares the same pages,
and a process's resident memory grows with what it reads, not with the size of the data. A store object
opens its maps lazily and drops them when pickled, so it travels to worker processes as a path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.data.samples import RowError, trained_per_sample

TOKEN_DTYPE = np.int32
#: columns of raw bytes rather than tokens (a grpo prompt's row as UTF-8 JSON): their name ends so
BYTES_SUFFIX = "_json"
#: columns of float64 values (a preference pair's scores, a reward pair's margin): their name ends so
VALUES_SUFFIX = "_values"
META = "meta.json"


def column_dtype(column: str) -> type:
    """A column's dtype on disk."""
    if column.endswith(VALUES_SUFFIX):
        return np.float64
    return np.uint8 if column.endswith(BYTES_SUFFIX) else TOKEN_DTYPE


def sample_dtype(column: str) -> type:
    """A column's dtype in a formatted sample and as ``get`` returns it: float64 for a values column (scores,
    margins), uint8 for a bytes column (a row as JSON, image references), else int64."""
    if column.endswith(BYTES_SUFFIX):
        return np.uint8
    return np.float64 if column.endswith(VALUES_SUFFIX) else np.int64


class StoreWriter:
    """Appends samples column by column; ``close`` writes the offsets and the metadata."""

    def __init__(self, directory: Path, columns: tuple[str, ...]) -> None:
        self.directory = directory
        self.columns = columns
        directory.mkdir(parents=True, exist_ok=True)
        self._files = {c: open(directory / f"{c}.bin", "wb") for c in columns}  # noqa: SIM115
        self._lengths: dict[str, list[np.ndarray]] = {c: [] for c in columns}
        self._trained: dict[str, list[np.ndarray]] = {c: [] for c in columns if c.endswith("labels")}
        self.count = 0

    def append(self, flat: dict[str, np.ndarray], lengths: dict[str, np.ndarray]) -> np.ndarray:
        """Append a batch of samples (each column concatenated, with per-sample lengths); returns their ids."""
        n = len(lengths[self.columns[0]])
        for column in self.columns:
            self._files[column].write(
                np.ascontiguousarray(flat[column], dtype=column_dtype(column)).tobytes()
            )
            self._lengths[column].append(np.asarray(lengths[column], dtype=np.int64))
        for column in self._trained:
            self._trained[column].append(trained_per_sample(flat[column], lengths[column]))
        ids = np.arange(self.count, self.count + n, dtype=np.int64)
        self.count += n
        return ids

    def close(self, extra: dict[str, Any] | None = None) -> None:
        for column in self.columns:
            self._files[column].close()
            lengths = _concat(self._lengths[column])
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            np.save(self.directory / f"{column}.idx.npy", offsets)
        for column, parts in self._trained.items():
            np.save(self.directory / f"{column}.trained.npy", _concat(parts).astype(np.int32))
        meta = {"samples": self.count, "columns": list(self.columns), **(extra or {})}
        (self.directory / META).write_text(json.dumps(meta, indent=1))


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class SampleStore:
    """Read-only access to a store directory; arrays are memory-mapped on first use in each process."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        meta = json.loads((self.directory / META).read_text())
        self.meta: dict[str, Any] = meta
        self.columns: tuple[str, ...] = tuple(meta["columns"])
        self.count: int = meta["samples"]
        self._maps: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}

    def _map(self, name: str) -> np.ndarray:
        found = self._maps.get(name)
        if found is None:
            path = self.directory / name
            if name.endswith(".npy"):
                found = np.load(path, mmap_mode="r")
            elif path.stat().st_size == 0:
                found = np.zeros(0, dtype=column_dtype(name.removesuffix(".bin")))
            else:
                found = np.memmap(path, dtype=column_dtype(name.removesuffix(".bin")), mode="r")
            self._maps[name] = found
        return found

    def offsets(self, column: str) -> np.ndarray:
        return self._map(f"{column}.idx.npy")

    def lengths(self, column: str = "input_ids") -> np.ndarray:
        return np.diff(self.offsets(column))

    def trained(self, column: str = "labels") -> np.ndarray:
        return self._map(f"{column}.trained.npy")

    def tokens(self, column: str) -> np.ndarray:
        return self._map(f"{column}.bin")

    def get(self, column: str, sample: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens ``start:stop`` of one sample's column, as an owned int64 array (float64 for a values
        column)."""
        offsets = self.offsets(column)
        begin, end = int(offsets[sample]), int(offsets[sample + 1])
        end = end if stop is None else min(end, begin + stop)
        return np.array(self.tokens(column)[begin + start : end], dtype=sample_dtype(column))


def loop_format(
    format_row: Callable[[dict[str, Any], Any, Any], dict[str, Any]],
) -> Callable[[list[dict[str, Any]], Any, Any], list[Any]]:
    """A batch formatter from a one-row formatter (rows that fail become their ``RowError``), each value in
    its stored dtype."""

    def format_batch(rows: list[dict[str, Any]], tokenizer: Any, config: Any) -> list[Any]:
        out: list[Any] = []
        for row in rows:
            try:
                sample = format_row(row, tokenizer, config)
                out.append({k: np.asarray(v, dtype=sample_dtype(k)) for k, v in sample.items()})
            except RowError as exc:
                out.append(exc)
        return out

    return format_batch
