"""Atomic writes: the file appears whole or not at all; a failed write leaves the old file and no debris."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.utils.fs import atomic_write, atomic_write_text


def test_writer_gets_a_sibling_with_the_same_suffix_and_the_result_is_renamed(tmp_path: Path) -> None:
    seen = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("new")

    out = tmp_path / "sub" / "plot.png"
    assert atomic_write(out, write) == out
    assert out.read_text() == "new"
    assert seen[0].parent == out.parent and seen[0].suffix == ".png" and seen[0].name.startswith(".plot.tmp-")
    assert sorted(p.name for p in out.parent.iterdir()) == ["plot.png"]


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "resolved.yaml"
    atomic_write_text(out, "old")

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(out, broken)
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resolved.yaml"]
