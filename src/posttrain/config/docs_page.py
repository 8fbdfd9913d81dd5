"""The config reference in ``docs/reference.md``, generated from the config classes' field docstrings (the
one source of truth). ``posttrain schema --markdown`` prints it; a test keeps the file current."""

from __future__ import annotations

import functools
import json
import operator
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from posttrain.config.base import nested_model, tagged_members
from posttrain.config.trainer import TrainerConfig
from posttrain.registry import DATA_SOURCES, SLOT_REGISTRIES, TRAINERS
from posttrain.utils.markdown import contents

HEADER = """# Config reference

Generated from the field docstrings in `src/posttrain/config/` by `posttrain schema --markdown`; do not edit
by hand (`tests/unit/test_reference_docs.py` fails when this file is out of date). `posttrain schema` prints
the same information as a JSON schema for editors ([Writing a config](configuration.md)).
"""


def _plain_type(annotation: Any) -> Any:
    """The annotation without ``Annotated`` metadata (validators print with memory addresses)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _plain_type(args[0])
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, (_plain_type(a) for a in args))
    if origin in (list, tuple, set, dict) and args:
        return origin[tuple(_plain_type(a) for a in args)]
    return annotation


def _type_name(annotation: Any) -> str:
    annotation = _plain_type(annotation)
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    text = re.sub(r"typing\.|posttrain\.[\w.]+\.|pydantic\.[\w.]+\.", "", text)
    text = re.sub(r"Annotated\[(\w+), [^\]]*\]", r"\1", text)  # HumanInt / HumanFloat -> int / float
    text = text.replace("NoneType", "None").replace("SerializeAsAny[", "").replace("]]", "]")
    return text.replace("|", "\\|")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    text = json.dumps(value, default=str)
    return f"`{text}`".replace("|", "\\|")


def _description(field: Any) -> str:
    text = " ".join((field.description or "").split())
    return text.replace("|", "\\|")


def section(title: str, cls: type[BaseModel], skip: set[str] | None = None) -> list[str]:
    lines = [
        f"## {title}",
        "",
        f"`{cls.__name__}`" + (f": {' '.join(cls.__doc__.split())}" if cls.__doc__ else ""),
        "",
    ]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        if skip and name in skip:
            continue
        alias = f" (alias `{field.alias}`)" if field.alias and field.alias != name else ""
        lines.append(
            f"| `{name}`{alias} | {_type_name(field.annotation)} | {_default(field)} | {_description(field)} |"
        )
    return [*lines, ""]


def reference_markdown() -> str:
    out: list[str] = []
    out += section("Top level (every trainer)", TrainerConfig)
    base_keys = set(TrainerConfig.model_fields)
    for name in TRAINERS.names():
        cls = TRAINERS.get(name).config
        extra = set(cls.model_fields) - base_keys
        if extra:
            out += section(f"Top level, `type: {name}` only", cls, skip=base_keys)
        for key in sorted(extra):  # lists of entries told apart by their type (grpo's rewards)
            for tag, member in tagged_members(cls.model_fields[key].annotation).items():
                out += section(f"`{key}[]` with `type: {tag}`", member)
    for key, field in TrainerConfig.model_fields.items():  # sections without a `type:` (logger, wandb...)
        nested = nested_model(field.annotation)
        if nested is not None and key not in SLOT_REGISTRIES:
            out += section(f"`{key}:`", nested)
    for slot, registry in SLOT_REGISTRIES.items():
        for name in registry.names():
            out += section(f"`{slot}:` with `type: {name}`", registry.get(name).config)
    for name in DATA_SOURCES.names():
        out += section(f"`data.sources[]` with `type: {name}`", DATA_SOURCES.get(name).config)
    headings = [line.removeprefix("## ") for line in out if line.startswith("## ")]
    return "\n".join([HEADER, *contents(headings), "", *out]).rstrip() + "\n"
