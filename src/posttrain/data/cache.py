"""The processed-data cache: one sample store (a directory) per content key, built by one process per node
(or one in all, on a shared file system) while the others wait, then memory-mapped by every process.

The key covers everything that changes the processed samples: the trainer type, the data options, the
effective ``max_length``, every source's config and fingerprint (a local file's content hash; a
``save_to_disk`` directory's metadata and file sizes; a hub dataset's name, split and arguments), the
tokenizer (its full serialisation, chat template and special tokens), the user's ``code:`` file and the
posttrain version. A store is built in a temporary directory that is renamed into place, so a reader never
sees half of one. With the cache off, the store is rebuilt on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import posttrain
from posttrain.config.data import DataSourceConfig
from posttrain.context import RunContext
from posttrain.data.build import Datasets, build_store, open_datasets
from posttrain.dist import barrier
from posttrain.logs import say

_NOT_CONTENT = {
    "cache_dir",
    "cache_fs_type",
    "num_proc",
    "dl_num_workers",
    "use_data_cache",
    "cache_processed_data",
}


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_fingerprint(source: DataSourceConfig) -> dict[str, Any]:
    record: dict[str, Any] = {"config": source.model_dump(mode="json")}
    path = Path(source.name_or_path).expanduser()
    if path.is_file():
        record["sha256"] = _file_digest(path)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        record["files"] = [
            (
                str(p.relative_to(path)),
                p.stat().st_size,
                _file_digest(p) if p.suffix == ".json" else p.stat().st_mtime_ns,
            )
            for p in files
        ]
    return record


def tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps(
        {
            "class": type(tokenizer).__name__,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "special": {k: str(v) for k, v in getattr(tokenizer, "special_tokens_map", {}).items()},
        },
        sort_keys=True,
    )
    return hashlib.sha256((body + extra).encode()).hexdigest()


def cache_key(ctx: RunContext, tokenizer: Any, max_length: int) -> str:
    config = ctx.config
    data = config.data.model_dump(mode="json", exclude=_NOT_CONTENT | {"sources", "eval_sources"})
    code = Path(config.code)
    record = {
        "version": posttrain.__version__,
        "trainer": config.type,
        "data": data,
        "max_length": max_length,
        "sources": [source_fingerprint(s) for s in config.data.sources],
        "eval_sources": [source_fingerprint(s) for s in config.data.eval_sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "code": _file_digest(code) if code.is_absolute() and code.is_file() else None,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


def _is_builder(ctx: RunContext) -> bool:
    if ctx.config.data.cache_fs_type == "shared":
        return ctx.dist.rank == 0
    return ctx.dist.local_rank == 0  # "local" and "auto": one builder per node


def load_datasets(ctx: RunContext, tokenizer: Any, max_length: int) -> Datasets:
    """The run's train and eval data: the cached store for this content key, built first when missing (or
    always, with the cache off) by one process while the others wait."""
    config = ctx.config.data
    key = cache_key(ctx, tokenizer, max_length)
    root = Path(config.cache_dir)
    directory = root / (key if config.cache_enabled else f"uncached-{key}")
    hit = config.cache_enabled and (directory / "reports.json").is_file()
    if not hit and _is_builder(ctx):
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".building-{key}-{uuid.uuid4().hex[:8]}"
        try:
            build_store(ctx, tokenizer, max_length, staging, show=ctx.dist.is_main)
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(staging, directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    barrier(ctx.dist)  # the others wait here until the builder has renamed the store into place
    started = time.perf_counter()
    data = open_datasets(directory)
    if hit:
        say(
            f"processed data loaded from the cache ({directory}, opened in {time.perf_counter() - started:.2f} s)"
        )
    return data
