"""docs/reference.md is generated from the field docstrings and must match the code."""

from __future__ import annotations

from pathlib import Path

from posttrain.config.reference import reference_markdown

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def test_reference_is_current() -> None:
    assert REFERENCE.read_text() == reference_markdown(), (
        "docs/reference.md is out of date: run `posttrain schema --markdown > docs/reference.md`"
    )


def test_every_field_has_a_docstring() -> None:
    rows = [line for line in reference_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) > 150
    missing = [row for row in rows if row.rstrip().endswith("|  |")]
    assert not missing, missing
