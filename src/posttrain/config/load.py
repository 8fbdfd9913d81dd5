"""From a YAML file (or text, or a dict) and command-line overrides to a validated ``TrainerConfig``.

The stages live in their own modules, each without side effects other than importing the user's ``code:``:
``yaml_source`` (YAML with line numbers, duplicate keys refused), ``overrides`` (``key.path=value``),
``user_code`` (the ``code:`` module) and ``resolve`` (``type:`` lookup, validation, derived defaults).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config.overrides import apply_overrides
from posttrain.config.resolve import resolve
from posttrain.config.trainer import TrainerConfig
from posttrain.config.yaml_source import RawConfig, load_yaml, load_yaml_text


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    text: str | None = None,
    data: dict[str, Any] | None = None,
    base_dir: Path | None = None,
) -> TrainerConfig:
    """Load, override, resolve and validate a config from a file, YAML text or a dict."""
    if path is not None:
        raw = load_yaml(path)
    elif text is not None:
        raw = load_yaml_text(text, base_dir=base_dir)
    else:
        raw = RawConfig(data=dict(data or {}), source="<dict>", base_dir=base_dir or Path.cwd())
    apply_overrides(raw, overrides or [])
    return resolve(raw)
