"""Checks of the agent keys (``tools``, ``environment_factory``) when the config loads: a tool's JSON schema
(typed arguments, a Google-style docstring), an environment class's ``reset`` and tool methods. The tools run
in ``rollout.tools`` and ``rollout.agent``."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the built-in tools by their name in ``tools:`` (``rollout.tools.load_tool``)
BUILTIN_TOOLS = ("python",)
#: the built-in tools' JSON schemas (``sandbox.python_tool.python_tool``'s, checked equal by a test)
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
    """What is wrong with an environment class: no ``reset`` or one that cannot take a row's columns as
    keywords, a ``get_reward`` that needs arguments, a tool method without a schema."""
    problems = []
    probe = object.__new__(cls)  # bound methods for their signatures; __init__ is not run
    reset = getattr(probe, "reset", None)
    if not callable(reset):
        problems.append(f"{cls.__name__} has no reset method (reset(**row) starts each rollout)")
    else:
        problems += _reset_problems(cls, reset)
    reward = getattr(probe, "get_reward", None)
    if callable(reward) and not accepts(reward):
        problems.append(
            f"{cls.__name__}.get_reward{signature(reward)} ({where_defined(reward)}) needs arguments; it is called "
            "with none after the rollout, and returns the rollout's reward (a number or None)"
        )
    for name in environment_tools(cls):
        try:
            schema_of(getattr(probe, name))
        except ValueError as exc:
            problems.append(f"{cls.__name__}.{exc}")
    return problems


def _reset_problems(cls: type, reset: Callable[..., Any]) -> list[str]:
    """``reset`` is called as ``reset(**row)``: it must take keywords (named columns, or ``**row``) and need
    no positional-only argument."""
    try:
        parameters = list(inspect.signature(reset).parameters.values())
    except (TypeError, ValueError):
        return []  # a built-in: nothing to read
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        keywords = True
    else:
        keywords = any(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if keywords and not positional:
        return []
    return [
        f"{cls.__name__}.reset{signature(reset)} ({where_defined(reset)}) cannot take a row: each rollout calls "
        "reset(**row) with the row's columns (prompt and the rest) as keywords; declare reset(self, **row), or "
        "name the columns it reads and add **row for the others"
    ]


def accepts(function: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether ``function`` can be called with these arguments (True where its signature cannot be read)."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def signature(function: Callable[..., Any]) -> str:
    """``(a, b=1)``: how a function is called, for a message."""
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(...)"


def where_defined(obj: Any) -> str:
    """``file:line`` where a user's function, method or class is defined ("a built-in" where none)."""
    target = inspect.unwrap(obj.__func__ if inspect.ismethod(obj) else obj)
    try:
        return f"{Path(inspect.getsourcefile(target) or '?').name}:{inspect.getsourcelines(target)[1]}"
    except (OSError, TypeError):
        return "a built-in"


def environment_factory_of(entry: str) -> Callable[[], Any]:
    """What ``environment_factory`` names: a class, or any callable taking no argument that returns an
    environment (TRL's ``EnvironmentFactory``: a function, a ``functools.partial``); ValueError naming what is
    wrong."""
    from posttrain.config.user_code import import_named

    factory = import_named(entry, "environment")
    if not accepts(factory):  # type: ignore[arg-type]
        raise ValueError(
            f"{entry}: {getattr(factory, '__name__', 'it')}{signature(factory)} ({where_defined(factory)}) needs "  # type: ignore[arg-type]
            "arguments; environment_factory is called with none for each rollout (give them defaults, or bind "
            "them with functools.partial in your file)"
        )
    return factory  # type: ignore[return-value]


def environment_class(entry: str) -> type:
    """The class of the environments ``entry`` builds: the entry itself when it is a class; a
    ``functools.partial``'s class; the class a function declares it returns (``-> Env``); else the class of
    one instance, built once per process to read its tools, as TRL probes one. ValueError naming what is
    wrong."""
    target: Any = environment_factory_of(entry)
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, type):
        return target
    if inspect.isfunction(target):
        try:
            returned = typing.get_type_hints(target).get("return")
        except Exception:  # an annotation naming something not imported: the instance tells
            returned = None
        if isinstance(returned, type) and returned is not type(None):
            return returned
    return _probed_class(entry)


@functools.cache
def _probed_class(entry: str) -> type:
    """The class of one instance of a factory that does not declare it (built once per process)."""
    factory = environment_factory_of(entry)
    try:
        instance = factory()
    except Exception as exc:
        raise ValueError(
            f"{entry}: calling it to read its environment's tools raised {type(exc).__name__}: {exc} "
            f"({_user_line(exc, entry)})"
        ) from None
    return type(instance)


def _user_line(exc: BaseException, entry: str) -> str:
    """``at file:line``: the deepest frame of the exception in the entry's file (else its last frame)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    file = str(Path(entry.rpartition(":")[0]).expanduser().resolve())
    mine = [f for f in frames if f.filename == file] or frames[-1:]
    return f"at {Path(mine[-1].filename).name}:{mine[-1].lineno}" if mine else "at an unknown line"


def environment_classes(factory: str | dict[str, str] | None) -> list[type]:
    """The distinct classes ``environment_factory`` builds (imported once per process)."""
    entries = factory.values() if isinstance(factory, dict) else [factory] if factory else []
    return list(dict.fromkeys(environment_class(entry) for entry in entries))


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
            cls = environment_class(entry)
            probe = object.__new__(cls)
            schemas += [schema_of(getattr(probe, method)) for method in environment_tools(cls)]  # type: ignore[arg-type]
        out[name] = schemas
    return out
