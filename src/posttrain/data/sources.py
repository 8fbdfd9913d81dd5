"""Data sources: where rows come from. Each returns a list of ``Row`` (the dict plus where it came from)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.data import DataSourceConfig, HFSourceConfig, LocalSourceConfig
from posttrain.context import RunContext
from posttrain.errors import DataError
from posttrain.registry import DATA_SOURCES


@dataclass(frozen=True)
class Row:
    """One input row; ``origin`` reads like ``data/train.jsonl row 17`` in error messages; ``process``:
    run the trainer's formatter on it (false: it already holds token ids and labels)."""

    data: dict[str, Any]
    origin: str
    process: bool = True


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path} row {number}: invalid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(value, dict):
                raise DataError(f"{path} row {number}: expected a JSON object, got {type(value).__name__}")
            rows.append(Row(value, f"{path} row {number}"))
    return rows


def _read_json(path: Path) -> list[Row]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON list of objects (or {{'data': [...]}})")
    rows = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise DataError(f"{path} row {index}: expected a JSON object, got {type(item).__name__}")
        rows.append(Row(item, f"{path} row {index}"))
    return rows


def _read_table(path: Path) -> list[Row]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
        first = 0
    else:
        import pandas as pd

        records = pd.read_csv(path).to_dict(orient="records")
        first = 2  # row numbers as seen in a spreadsheet: the header is line 1
    return [Row(record, f"{path} row {index + first}") for index, record in enumerate(records)]


@DATA_SOURCES.register("local", config=LocalSourceConfig)
def load_local(config: LocalSourceConfig, ctx: RunContext) -> list[Row]:
    path = Path(config.name_or_path).expanduser()
    if not path.is_file():
        raise DataError(f"data source {config.name_or_path!r}: no such file")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_table, ".csv": _read_table}
    return readers[path.suffix](path)


@DATA_SOURCES.register("huggingface", config=HFSourceConfig)
def load_huggingface(config: HFSourceConfig, ctx: RunContext) -> list[Row]:
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
    return [
        Row(dict(record), f"{config.name_or_path}[{split}] row {index}")
        for index, record in enumerate(loaded)
    ]


def load_source(config: DataSourceConfig, ctx: RunContext) -> list[Row]:
    """Read a source and apply its ``sample_ratio`` / ``sample_count``."""
    rows = DATA_SOURCES.get(config.type).obj(config, ctx)
    count = None
    if config.sample_count is not None:
        count = min(config.sample_count, len(rows))
    elif config.sample_ratio is not None:
        count = round(len(rows) * config.sample_ratio)
    if count is not None:
        keep = sorted(random.Random(config.sample_seed).sample(range(len(rows)), count))
        rows = [rows[i] for i in keep]
    return rows
