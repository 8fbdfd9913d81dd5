"""Data sources: where rows come from.

A source returns a ``RowReader``: its row count, known before reading (so sampling and splits are drawn on
row numbers), and one pass over the rows in order, reading the file in bounded chunks. Only the rows asked for
are parsed. Each row carries where it came from (``data/train.jsonl row 17``) for error messages. A user
source may also return a plain list of ``Row``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from posttrain.config.data import DataSourceConfig, HFSourceConfig, LocalSourceConfig
from posttrain.context import RunContext
from posttrain.errors import DataError
from posttrain.registry import DATA_SOURCES

CHUNK_ROWS = 1024


@dataclass(frozen=True)
class Row:
    """One input row; ``origin`` reads like ``data/train.jsonl row 17`` in error messages. Whether it is
    formatted or already holds token ids is its source's ``process`` setting."""

    data: dict[str, Any]
    origin: str
    error: str = ""  # a row that could not even be read (invalid JSON): reported with the other bad rows


class RowReader(Protocol):
    def __len__(self) -> int: ...

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        """The rows numbered in ``wanted`` (sorted, 0-based), or every row, in order."""
        ...


class RandomAccessReader(RowReader, Protocol):
    """A reader that can read any rows by number: formatting workers then read their own chunks."""

    def read(self, numbers: np.ndarray) -> list[Row]: ...


def _select(numbered: Iterable[tuple[int, Any]], wanted: np.ndarray | None) -> Iterator[tuple[int, Any]]:
    """Pass through the items whose running number is in ``wanted`` (sorted), stopping after the last."""
    if wanted is None:
        yield from numbered
        return
    if len(wanted) == 0:
        return
    position, target = 0, int(wanted[0])
    for number, item in numbered:
        if number == target:
            yield number, item
            position += 1
            if position == len(wanted):
                return
            target = int(wanted[position])


def rows_by_number(reader: RandomAccessReader, wanted: np.ndarray | None) -> Iterator[Row]:
    """A random-access reader's rows in order, read ``CHUNK_ROWS`` numbers at a time."""
    numbers = np.arange(len(reader)) if wanted is None else wanted
    for start in range(0, len(numbers), CHUNK_ROWS):
        yield from reader.read(numbers[start : start + CHUNK_ROWS])


class ListReader:
    """Rows already in memory (user sources that return a list)."""

    def __init__(self, rows: list[Row]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        for _, row in _select(enumerate(self._rows), wanted):
            yield row


class JsonlReader:
    """One JSON object per line; blank lines are skipped (row numbers are line numbers). The first pass
    records where each row starts and its line number (16 bytes a row), so any row can be read directly."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._index: tuple[np.ndarray, np.ndarray] | None = None

    def _offsets(self) -> tuple[np.ndarray, np.ndarray]:
        if self._index is None:
            starts, numbers, offset = [], [], 0
            with open(self.path, "rb") as handle:
                for number, line in enumerate(handle, start=1):
                    if line.strip():
                        starts.append(offset)
                        numbers.append(number)
                    offset += len(line)
            self._index = np.array(starts, np.int64), np.array(numbers, np.int64)
        return self._index

    def __len__(self) -> int:
        return len(self._offsets()[0])

    def _parse(self, line: bytes, number: int) -> Row:
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            detail = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
            return Row({}, f"{self.path} row {number}", f"invalid JSON ({detail})")
        if not isinstance(value, dict):
            return Row({}, f"{self.path} row {number}", f"expected a JSON object, got {type(value).__name__}")
        return Row(value, f"{self.path} row {number}")

    def read(self, numbers: np.ndarray) -> list[Row]:
        starts, lines = self._offsets()
        rows = []
        with open(self.path, "rb") as handle:
            for index in np.asarray(numbers).tolist():
                handle.seek(int(starts[index]))
                rows.append(self._parse(handle.readline(), int(lines[index])))
        return rows

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        return rows_by_number(self, wanted)


class JsonReader:
    """A JSON list of objects (or ``{"data": [...]}``). A JSON document is parsed whole: use JSONL or
    Parquet for large data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._items: list[Any] | None = None

    def _load(self) -> list[Any]:
        if self._items is None:
            try:
                value = json.loads(self.path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{self.path}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
                ) from None
            if isinstance(value, dict) and isinstance(value.get("data"), list):
                value = value["data"]
            if not isinstance(value, list):
                raise DataError(f"{self.path}: expected a JSON list of objects (or {{'data': [...]}})")
            self._items = value
        return self._items

    def __len__(self) -> int:
        return len(self._load())

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        for index, item in _select(enumerate(self._load()), wanted):
            if not isinstance(item, dict):
                raise DataError(f"{self.path} row {index}: expected a JSON object, got {type(item).__name__}")
            yield Row(item, f"{self.path} row {index}")


class ParquetReader:
    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        self.path = path
        self._file = pq.ParquetFile(path)

    def __len__(self) -> int:
        return int(self._file.metadata.num_rows)

    def _records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        number = 0
        for batch in self._file.iter_batches(batch_size=CHUNK_ROWS):
            for record in batch.to_pylist():
                yield number, record
                number += 1

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        for index, record in _select(self._records(), wanted):
            yield Row(record, f"{self.path} row {index}")


class CsvReader:
    """Row numbers as seen in a spreadsheet: the header is line 1, so the first row is row 2."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._count: int | None = None

    def _records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        import pandas as pd

        number = 0
        for frame in pd.read_csv(self.path, chunksize=CHUNK_ROWS):
            for record in frame.to_dict(orient="records"):
                yield number, record
                number += 1

    def __len__(self) -> int:
        if self._count is None:
            self._count = sum(1 for _ in self._records())
        return self._count

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        for index, record in _select(self._records(), wanted):
            yield Row(record, f"{self.path} row {index + 2}")


class HFReader:
    """A ``datasets.Dataset`` (Arrow, memory-mapped by ``datasets``), read in batches."""

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset = dataset
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, numbers: np.ndarray) -> list[Row]:
        chunk = numbers.tolist()
        if not chunk:
            return []
        contiguous = chunk[-1] - chunk[0] == len(chunk) - 1
        batch = self.dataset[chunk[0] : chunk[-1] + 1] if contiguous else self.dataset[chunk]
        return [
            Row({key: batch[key][offset] for key in batch}, f"{self.name} row {number}")
            for offset, number in enumerate(chunk)
        ]

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        return rows_by_number(self, wanted)


def load_local(config: LocalSourceConfig, ctx: RunContext) -> RowReader:
    path = Path(config.name_or_path).expanduser()
    if not path.is_file():
        raise DataError(f"data source {config.name_or_path!r}: no such file")
    readers = {".jsonl": JsonlReader, ".json": JsonReader, ".parquet": ParquetReader, ".csv": CsvReader}
    return readers[path.suffix](path)


def load_huggingface(config: HFSourceConfig, ctx: RunContext) -> RowReader:
    import datasets

    path = Path(config.name_or_path).expanduser()
    split = config.split or "train"
    try:
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(config.name_or_path, split=split, **config.kwargs)
    except Exception as exc:  # datasets raises many types; the user needs the message, not the stack
        raise DataError(
            f"data source {config.name_or_path!r} (split {split!r}): {type(exc).__name__}: {exc}"
        ) from None
    return HFReader(loaded, f"{config.name_or_path}[{split}]")


def open_source(config: DataSourceConfig, ctx: RunContext) -> RowReader:
    found = DATA_SOURCES.get(config.type).obj(config, ctx)
    reader = ListReader(found) if isinstance(found, list) else found
    if config.columns or config.roles:
        return MappedReader(reader, config.columns, config.roles)
    return reader


#: the keys of a chat row whose turns (lists of objects) are renamed too
TURN_LISTS = ("messages", "conversations", "prompt", "completion", "chosen", "rejected")


class MappedReader:
    """A source's rows with the file's own names mapped to the ones posttrain reads: ``columns`` maps a
    posttrain name to the file's (``{conversations: dialog, from: speaker, value: text}``), at the top of
    the row and inside its turns; ``roles`` maps the file's role names to posttrain's or ShareGPT's
    (``{bot: assistant}``). A renamed key that clashes with one already in the row is refused."""

    def __init__(self, reader: RowReader, columns: dict[str, str], roles: dict[str, str]) -> None:
        self.reader = reader
        self.renames = {theirs: ours for ours, theirs in columns.items()}
        self.roles = roles
        if hasattr(reader, "read"):
            self.read = self._read

    def __len__(self) -> int:
        return len(self.reader)

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        for row in self.reader.rows(wanted):
            yield Row(self.mapped(row), row.origin, row.error)

    def _read(self, numbers: np.ndarray) -> list[Row]:
        return [Row(self.mapped(row), row.origin, row.error) for row in self.reader.read(numbers)]  # type: ignore[attr-defined]

    def _renamed(self, data: dict[str, Any], origin: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = self.renames.get(key, key)
            if name in out:
                raise DataError(f"{origin}: columns maps {key!r} to {name!r}, which the row already has")
            out[name] = value
        return out

    def mapped(self, row: Row) -> dict[str, Any]:
        data = self._renamed(row.data, row.origin)
        for key in TURN_LISTS:
            turns = data.get(key)
            if isinstance(turns, list):
                data[key] = [self._turn(t, row.origin) if isinstance(t, dict) else t for t in turns]
        return data

    def _turn(self, turn: dict[str, Any], origin: str) -> dict[str, Any]:
        turn = self._renamed(turn, origin)
        for field in ("role", "from"):
            if field in turn and turn[field] in self.roles:
                turn[field] = self.roles[turn[field]]
        return turn


def sample_rows(count: int, config: DataSourceConfig) -> np.ndarray | None:
    """Row numbers kept by ``sample_ratio`` / ``sample_count`` (sorted), or None for every row."""
    keep = None
    if config.sample_count is not None:
        keep = min(config.sample_count, count)
    elif config.sample_ratio is not None:
        keep = round(count * config.sample_ratio)
    if keep is None:
        return None
    rng = np.random.default_rng(config.sample_seed)
    return np.sort(rng.choice(count, size=keep, replace=False)).astype(np.int64)
