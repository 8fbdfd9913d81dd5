"""Every bundled example config is a valid config as it stands (run from the repository's root, as the README
runs them): a key renamed in the schema or an example's user code moved breaks this, not a user's first run."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_the_example_validates(example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples' paths are the repository's
    config = load_config(ROOT / "examples" / example)
    prefix = example.split("-")[0]
    assert config.type == {"lora": "sft"}.get(prefix, prefix)  # each file is named for its method
