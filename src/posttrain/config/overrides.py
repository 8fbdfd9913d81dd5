"""Stage 2 of loading: ``key.path=value`` overrides from the command line, applied to the loaded data."""

from __future__ import annotations

import functools
from typing import Any

import yaml
from pydantic import BaseModel

from posttrain.config.base import nested_model
from posttrain.config.errors import ConfigIssue, format_path
from posttrain.config.trainer import TrainerConfig
from posttrain.config.yaml_source import Loc, RawConfig
from posttrain.registry import SLOT_REGISTRIES, TRAINERS


def _parse_override_path(text: str) -> Loc:
    loc: list[str | int] = []
    for part in text.replace("[", ".").replace("]", "").split("."):
        if not part:
            raise ValueError(f"empty key in {text!r}")
        loc.append(int(part) if part.isdigit() else part)
    return tuple(loc)


@functools.cache
def alias_twins() -> dict[str, str]:
    """Field name <-> alias of every config class (``lr``/``learning_rate``...), so an override written
    with one spelling replaces the other spelling in the file."""
    classes: list[type[BaseModel]] = [TrainerConfig]
    for registry in [*SLOT_REGISTRIES.values(), TRAINERS]:
        classes += [registry.get(name).config for name in registry.names()]
    twins: dict[str, str] = {}
    seen: set[type] = set()
    while classes:
        cls = classes.pop()
        if cls in seen or not isinstance(cls, type) or not issubclass(cls, BaseModel):
            continue
        seen.add(cls)
        for name, info in cls.model_fields.items():
            if info.alias:
                twins[name], twins[info.alias] = info.alias, name
            nested = nested_model(info.annotation)
            if nested is not None:
                classes.append(nested)
    return twins


def apply_overrides(raw: RawConfig, overrides: list[str]) -> None:
    """Apply ``key.path=value`` overrides (values parsed as YAML scalars/lists/maps)."""
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raw.issues.append(
                ConfigIssue("", f"override {override!r} is not of the form key.path=value", "command line")
            )
            continue
        try:
            loc = _parse_override_path(key.strip())
            value = yaml.safe_load(text) if text.strip() else ""
        except (ValueError, yaml.YAMLError) as exc:
            raw.issues.append(ConfigIssue(key, f"bad override {override!r}: {exc}", "command line"))
            continue
        target: Any = raw.data
        for depth, part in enumerate(loc[:-1]):
            nxt = loc[depth + 1]
            if isinstance(target, dict):
                if not isinstance(target.get(part), dict | list):
                    target[part] = [] if isinstance(nxt, int) else {}
                target = target[part]
            elif isinstance(target, list) and isinstance(part, int) and part <= len(target):
                if part == len(target):
                    target.append([] if isinstance(nxt, int) else {})
                elif isinstance(target[part], str) and not isinstance(nxt, int):
                    target[part] = {"name_or_path": target[part]}  # a source's string shorthand
                target = target[part]
            else:
                target = None
                break
        last = loc[-1]
        if isinstance(target, dict):
            twin = alias_twins().get(str(last))
            if twin is not None and twin in target:  # `lr=` replaces a `learning_rate:` from the file
                del target[twin]
            target[last] = value
        elif isinstance(target, list) and isinstance(last, int) and last <= len(target):
            target[last : last + 1] = [value]
        else:
            raw.issues.append(
                ConfigIssue(
                    format_path(loc), f"override {override!r} does not fit the config's shape", "command line"
                )
            )
            continue
        for end in range(1, len(loc) + 1):
            raw.origins.setdefault(loc[:end], "command line")
        raw.origins[loc] = "command line"
