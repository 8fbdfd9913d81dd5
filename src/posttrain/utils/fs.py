"""Atomic writes: a user's files are never left half-written."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``target`` in one rename.

    An existing ``target`` is moved aside first and deleted only after the new one is in place, so a crash
    leaves either the old or the new directory, never a mix. On error the temporary directory is removed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Let ``write`` create a temporary sibling file (same suffix, so writers that infer the format from it
    work), then rename it over ``path``. On error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file through a temporary file and a rename."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    atomic_write(path, write)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
