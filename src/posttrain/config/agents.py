"""Checks of the agent keys (``tools``, ``environment_factory``) when the config loads: a tool's JSON schema
(typed arguments, a Google-style docstring), an environment class's ``reset`` and tool methods. The tools run
in ``rollout.tools`` and ``rollout.agent``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

#: the built-in tools by their name in ``tools:`` (``rollout.tools.load_tool``)
BUILTIN_TOOLS = ("python",)
#: the built-in tools' JSON schemas (``rollout.sandbox.python``'s, checked equal by a test)
BUILTIN_SCHEMAS: dict[str, dict[str, Any]] = {
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the Python program to run"}},
                "required": ["code"],
            },
            "return": {"type": "string"},
        },
    }
}
#: an environment's methods that are not tools
ENVIRONMENT_HOOKS = ("reset", "get_reward")


def schema_of(function: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema as chat templates take it; ValueError naming what is missing (an untyped or
    undescribed argument, no docstring)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as exc:  # transformers' TypeHintParsingException / DocstringParsingException
        name = getattr(function, "__name__", repr(function))
        raise ValueError(
            f"tool {name!r}: {exc}; a tool is a function with type hints on every argument and a Google-style "
            "docstring describing it (Args: name: what it is)"
        ) from None


def environment_tools(cls: type) -> list[str]:
    """The names of an environment class's tools: its public functions other than ``reset`` and
    ``get_reward`` (read on the class, so that properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ENVIRONMENT_HOOKS
    ]


def environment_problems(cls: type) -> list[str]:
    """What is wrong with an environment class: no ``reset``, a tool method without a schema."""
    problems = []
    if not callable(getattr(cls, "reset", None)):
        problems.append(f"{cls.__name__} has no reset method (reset(**row) starts each rollout)")
    probe = object.__new__(cls)  # bound methods for their signatures; __init__ is not run
    for name in environment_tools(cls):
        try:
            schema_of(getattr(probe, name))
        except ValueError as exc:
            problems.append(f"{cls.__name__}.{exc}")
    return problems


def environment_classes(factory: str | dict[str, str] | None) -> list[type]:
    """The distinct classes ``environment_factory`` names (imported once per process)."""
    from posttrain.config.user_code import import_named

    entries = factory.values() if isinstance(factory, dict) else [factory] if factory else []
    return list(dict.fromkeys(import_named(entry, "class") for entry in entries))  # type: ignore[misc]


def scoring_environments(factory: str | dict[str, str] | None) -> list[type]:
    """The environment classes that score their rollouts (a ``get_reward`` method)."""
    return [cls for cls in environment_classes(factory) if callable(getattr(cls, "get_reward", None))]


def tool_problems(entries: list[str]) -> list[str]:
    """What is wrong with the ``tools`` entries: not importable, no schema, named twice."""
    from posttrain.config.user_code import import_named

    problems = []
    for entry in entries:
        if entry in BUILTIN_TOOLS:
            continue
        try:
            schema_of(import_named(entry))  # type: ignore[arg-type]
        except ValueError as exc:
            problems.append(f"{entry}: {exc}")
    if len(set(entries)) < len(entries):
        problems.append("a tool is named twice")
    return problems


def tool_schemas(tools: list[str], factory: str | dict[str, str] | None) -> dict[str, list[dict[str, Any]]]:
    """The schemas a prompt is rendered with: the functions', then its environment's methods'; by environment
    name (``""`` when one environment, or none, serves every row)."""
    from posttrain.config.user_code import import_named

    functions = [BUILTIN_SCHEMAS[t] if t in BUILTIN_TOOLS else schema_of(import_named(t)) for t in tools]  # type: ignore[arg-type]
    entries = factory if isinstance(factory, dict) else {"": factory} if factory else {"": None}
    out = {}
    for name, entry in entries.items():
        schemas = list(functions)
        if entry:
            cls = import_named(entry, "class")
            probe = object.__new__(cls)  # type: ignore[call-overload]
            schemas += [schema_of(getattr(probe, method)) for method in environment_tools(cls)]  # type: ignore[arg-type]
        out[name] = schemas
    return out
