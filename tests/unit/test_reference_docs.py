"""docs/reference.md is generated from the field docstrings and must match the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from posttrain.testing.env import child_env

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def fresh_reference() -> str:
    """Generated in a fresh process: components that other tests register in this one must not appear."""
    command = [sys.executable, "-m", "posttrain", "schema", "--markdown"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=child_env(), check=True)
    return done.stdout


def test_reference_is_current() -> None:
    assert REFERENCE.read_text() == fresh_reference(), (
        "docs/reference.md is out of date: run `posttrain schema --markdown > docs/reference.md`"
    )


def test_every_field_has_a_docstring() -> None:  # the file is current (test above)
    rows = [line for line in REFERENCE.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) > 150
    missing = [row for row in rows if row.rstrip().endswith("|  |")]
    assert not missing, missing


def test_every_section_has_a_heading() -> None:
    headings = {line for line in REFERENCE.read_text().splitlines() if line.startswith("## ")}
    for key in ("logger", "wandb", "tracking", "tensorboard", "metrics", "profiling"):
        assert f"## `{key}:`" in headings
