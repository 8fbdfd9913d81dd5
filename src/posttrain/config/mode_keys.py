"""Settings that only apply in some modes, warned about in one way.

A key written in the file (or an override) whose mode is off has no effect: ``profiling.profile_step_start``
without the profiler, ``label_smoothing`` with the ipo loss, ``lora_plus_scale`` without adapters. Each config
class declares its own such keys (``BaseConfig.mode_keys``); this module walks the config and reports every
written one whose mode is off, the same way for every command that validates (``validate``, ``train``,
``preprocess``, ``plot-lr``): never silently ignored, never an error (a run can keep its W&B project while W&B
is turned off). Only keys the user wrote are reported; defaults never are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from posttrain.config.base import join_path


def _sections(model: BaseModel, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], BaseModel]]:
    """Every config section with its path (field names and list indices), the root first."""
    yield path, model
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _sections(value, (*path, name))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _sections(item, (*path, name, index))


def _dotted(path: tuple[Any, ...]) -> str:
    text = ""
    for part in path:
        text = f"{text}[{part}]" if isinstance(part, int) else join_path(text, part)
    return text


def inert_settings(config: Any) -> Iterator[tuple[str, str]]:
    """(key path, what it needs) for every written key whose mode is off."""
    derived = getattr(config, "_derived", set())  # filled in from other values, not written
    for path, section in _sections(config):
        for entry in getattr(type(section), "mode_keys", ()):
            written = [k for k in entry.keys if k in section.model_fields_set and (*path, k) not in derived]
            if written and not entry.applies(section, config):
                for key in written:
                    yield _dotted((*path, key)), entry.needs


def inert_warnings(config: Any) -> list[str]:
    return [f"{path} has no effect: it is used only with {needs}" for path, needs in inert_settings(config)]


def config_warnings(config: Any) -> list[str]:
    """Everything validation says without refusing: the written keys whose mode is off, then the config's
    own advice (``advice()``: a setting that works here and not where the run is going)."""
    advice = getattr(config, "advice", None)
    return [*inert_warnings(config), *(advice() if advice is not None else [])]
