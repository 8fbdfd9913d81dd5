"""Tools an online method's model may call while it generates (TRL's ``tools`` and ``environment_factory``):
loading them, reading tool calls out of generated text in the model's own format, and calling them with a time
limit. Their checks and JSON schemas (when the config loads) are ``config/agents.py``'s.

A tool is a typed function with a Google-style docstring (what ``transformers.utils.get_json_schema`` reads:
every argument typed and described), sync or ``async``, named in the config as ``path/file.py:function``, or a
built-in (``python``: code run in the sandbox, ``sandbox.confine``). An environment is a class
(``path/file.py:Class``, or a callable there returning one) with ``reset(**row)``; its public methods are its tools, bound to the instance of the
rollout, and an optional ``get_reward()`` scores the rollout.

A tool that raises, times out (``tool_timeout``) or is not known answers the model with the error as text,
``{'error': '...'}``, as TRL does, and counts in ``tools/failure_frequency``; the first error each tool's own
code raises is said once, naming the tool's class and line. A sync tool that runs past its
time is left running in its thread (Python cannot stop a thread) and its answer ignored; a tool that must be
stopped runs its work in a process (the built-in ``python`` tool does).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from posttrain.config.agents import accepts, where_defined
from posttrain.rewards.calls import user_frame


def load_tool(entry: str, accept_weaker_sandbox: bool = False) -> Callable[..., Any]:
    """The function a ``tools:`` entry names (a built-in or ``path/file.py:function``;
    ``accept_weaker_sandbox``: the run's ``sandbox_accept_weaker``, for the built-in ``python``)."""
    if entry == "python":
        from posttrain.sandbox.python_tool import python_tool

        return python_tool(strict=not accept_weaker_sandbox)
    from posttrain.config.user_code import import_named

    return import_named(entry)  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_message(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call(value: Any) -> ToolCall | None:
    """A ``{"name": ..., "arguments" | "parameters": {...}}`` object (arguments may be a JSON string)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def _json_calls(texts: Sequence[str]) -> list[ToolCall] | None:
    calls = []
    for text in texts:
        try:
            found = _call(json.loads(text))
        except json.JSONDecodeError:
            return None
        if found is None:
            return None
        calls.append(found)
    return calls


def parse_hermes(text: str) -> list[ToolCall]:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more."""
    return _json_calls(_HERMES.findall(text)) or []


def parse_llama3_json(text: str) -> list[ToolCall]:
    """Llama 3.1's JSON tool calls: the whole message is ``{"name": ..., "parameters": {...}}`` (after an
    optional ``<|python_tag|>``), several separated by ``;``."""
    body = text.split("<|python_tag|>", 1)[-1].strip()
    if not body.startswith("{"):
        return []
    return _json_calls([part for part in (p.strip() for p in body.split(";")) if part]) or []


def parse_mistral(text: str) -> list[ToolCall]:
    """Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` or, from v11 templates,
    ``[TOOL_CALLS]name[ARGS]{...}`` per call."""
    if "[TOOL_CALLS]" not in text:
        return []
    body = text.split("[TOOL_CALLS]", 1)[1].strip()
    if body.startswith("["):
        try:
            listed = json.loads(body)
        except json.JSONDecodeError:
            return []
        calls = [_call(item) for item in listed] if isinstance(listed, list) else []
        return [] if None in calls or not calls else calls  # type: ignore[return-value]
    out = []
    for part in text.split("[TOOL_CALLS]")[1:]:
        name, _, arguments = part.partition("[ARGS]")
        found = _call({"name": name.strip(), "arguments": arguments.strip()})
        if found is None:
            return []
        out.append(found)
    return out


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def tool_format(tokenizer: Any, chosen: str) -> str:
    """The format tool calls are read in: the one chosen, else transformers' response parsing where the
    tokenizer has a response template, else the one its chat template writes tool calls in."""
    if chosen != "auto":
        return chosen
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return "transformers"
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def parse_calls(
    tokenizer: Any, form: str, text: str, ids: list[int], prefix: list[int], tools: list[dict]
) -> list[ToolCall]:
    """The tool calls of a generated turn (none when it has none or they do not parse: the turn is then the
    answer, as TRL reads a malformed call)."""
    if form != "transformers":
        return PARSERS[form](text)
    schema = getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
    try:
        parsed = tokenizer.parse_response(ids, schema=schema, prefix=prefix, tools=tools or None)
    except Exception:  # a turn the parser cannot read is text, as TRL reads it
        return []
    calls = [_call((c or {}).get("function", c)) for c in parsed.get("tool_calls") or []]
    return [c for c in calls if c is not None]


# ------------------------------------------------------------------------------------------ calling them


def _error(text: str) -> str:
    return str({"error": text})


class ToolRunner:
    """Runs a batch's tool calls: the rollouts in parallel, the calls of one rollout in order (they may share
    its environment), each call in a thread of its own, waited for ``timeout`` seconds."""

    def __init__(self, timeout: float, workers: int = 16) -> None:
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="posttrain-tools")
        #: by tool name, the first error a tool's own code raised: ``Class.method (file:line) raised ...``
        self.raised: dict[str, str] = {}

    def run(
        self, calls: list[list[ToolCall]], tables: list[dict[str, Callable[..., Any]]]
    ) -> list[list[tuple[str, str, bool]]]:
        """For each rollout, ``(tool name, result text, failed)`` per call."""
        drivers = [self.pool.submit(self._rollout, c, t) for c, t in zip(calls, tables, strict=True)]
        return [driver.result() for driver in drivers]

    def _rollout(
        self, calls: list[ToolCall], table: dict[str, Callable[..., Any]]
    ) -> list[tuple[str, str, bool]]:
        out = []
        for call in calls:
            box: list[tuple[str, bool]] = []
            worker = threading.Thread(target=lambda c=call, b=box: b.append(self._one(c, table)), daemon=True)
            worker.start()
            worker.join(self.timeout)
            text, failed = box[0] if box else (_error(f"timed out after {self.timeout:g} s"), True)
            out.append((call.name, text, failed))
        return out

    def _one(self, call: ToolCall, table: dict[str, Callable[..., Any]]) -> tuple[str, bool]:
        function = table.get(call.name)
        if function is None:
            return _error(f"Tool {call.name} not found."), True
        try:
            result = function(**call.arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
        except Exception as exc:  # the model reads what went wrong, as TRL does; the user reads it once
            if not accepts(function, **call.arguments):
                return _error(str(exc)), True  # the model's slip (an argument the tool does not take)
            frame = user_frame(exc)
            self.raised.setdefault(
                call.name,
                f"tool {getattr(function, '__qualname__', call.name)} ({where_defined(function)}) raised "
                f"{type(exc).__name__}: {exc}{' at ' + frame if frame else ''}",
            )
            return _error(str(exc)), True
        return str(result), False

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def _awaited(value: Any) -> Any:
    return await value
