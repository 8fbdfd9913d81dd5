"""The processed-data cache: one sample store (a directory) per content key, built by one process per node
(or one in all, on a shared file system) while the others wait, then memory-mapped by every process.

The key covers everything that changes the processed samples: the trainer type, the data options, the
effective ``max_length``, every source's config and fingerprint (a local file's content hash, or for a file
over 256 MiB its size, modification time and first and last 4 MiB; a
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

import psutil

import posttrain
from posttrain.config.data import DataSourceConfig
from posttrain.context import RunContext
from posttrain.data.build import REPORTS, Datasets, build_store, data_factory, open_datasets
from posttrain.dist import barrier
from posttrain.errors import DataError
from posttrain.logs import say
from posttrain.utils.fs import atomic_write_text
from posttrain.vision.processor import fingerprint as processor_fingerprint

_NOT_CONTENT = {
    "cache_dir",
    "cache_fs_type",
    "num_proc",
    "dl_num_workers",
    "use_data_cache",
    "cache_processed_data",
}


#: files up to this size are hashed whole; larger ones by size, modification time, and their first and last
#: ``EDGE_BYTES``, so the key costs the same whatever the data size
FULL_HASH_BYTES = 256 * 2**20
EDGE_BYTES = 4 * 2**20


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(f"{size} {path.stat().st_mtime_ns}".encode())
            digest.update(handle.read(EDGE_BYTES))
            handle.seek(size - EDGE_BYTES)
            digest.update(handle.read(EDGE_BYTES))
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
            "processor": processor_fingerprint(tokenizer),  # how many tokens each image becomes
        },
        sort_keys=True,
    )
    return hashlib.sha256((body + extra).encode()).hexdigest()


def cache_key(ctx: RunContext, tokenizer: Any, max_length: int) -> str:
    config = ctx.config
    factory = data_factory(config.data, tokenizer)
    data = config.data.model_dump(mode="json", exclude=_NOT_CONTENT | {"sources", "eval_sources"})
    code = Path(config.code)
    record = {
        "version": posttrain.__version__,
        "trainer": config.type,
        "columns": list(factory.columns),  # the stored layout
        "format": factory.revision,  # how rows become tokens
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
    failed = root / f".failed-{directory.name}"
    builder = _is_builder(ctx)
    if not config.cache_enabled:
        if builder:
            shutil.rmtree(directory, ignore_errors=True)
        barrier(ctx.dist)  # nobody may open the previous run's store
    hit = (directory / REPORTS).is_file()
    if not hit and builder:
        _build(ctx, tokenizer, max_length, directory, failed)
    elif not hit:
        _wait_for_store(directory, failed)
    barrier(ctx.dist)
    started = time.perf_counter()
    data = open_datasets(directory)
    if hit:
        say(
            f"processed data loaded from the cache ({directory}, opened in {time.perf_counter() - started:.2f} s)"
        )
    return data


def _build(ctx: RunContext, tokenizer: Any, max_length: int, directory: Path, failed: Path) -> None:
    """Build in a temporary directory and rename it into place; on failure leave a note for the waiting
    processes (they would otherwise wait for ever)."""
    root = directory.parent
    root.mkdir(parents=True, exist_ok=True)
    failed.unlink(missing_ok=True)
    staging = root / f".building-{directory.name}-{uuid.uuid4().hex[:8]}"
    try:
        build_store(ctx, tokenizer, max_length, staging, show=ctx.dist.is_main)
        if not (directory / REPORTS).is_file():  # another node's builder may have finished first
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(staging, directory)
    except BaseException as exc:
        atomic_write_text(
            failed, f"{type(exc).__name__}: {exc}" if not isinstance(exc, DataError) else str(exc)
        )
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _wait_for_store(directory: Path, failed: Path) -> None:
    """Wait for the builder by watching the file system rather than in a collective: a large build can take
    longer than a process group's timeout. A failure note older than this process is a previous run's."""
    born = psutil.Process().create_time()
    while not (directory / REPORTS).is_file():
        if failed.is_file() and failed.stat().st_mtime >= born:
            raise DataError(f"the data build on another process failed: {failed.read_text()}")
        time.sleep(0.5)
