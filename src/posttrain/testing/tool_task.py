"""A task a small model does badly alone and well with a tool: multiply two numbers, with ``multiply`` to call.
Rows for its three uses: tool-call SFT (the model learns the call format and to copy the tool's answer), direct
SFT (the answer from the model's own arithmetic) and prompts for online RL (``answer`` for ``exact_match``).
The tests and ``examples/agent_demo.py`` train on it; this file is also the tool's file
(``tools: [<this file>:multiply]``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: first factor
        b: second factor
    """
    return int(a) * int(b)


class Calculator:
    """The agent demo's environment (TRL's ``environment_factory``): ``multiply`` is its tool; ``get_reward``
    is 1 when the last product the rollout computed is the row's answer (the agent computed what was asked),
    else 0."""

    def reset(self, answer: str, **row: Any) -> None:
        self.answer, self.last = str(answer), None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: first factor
            b: second factor
        """
        self.last = int(a) * int(b)
        return self.last

    def get_reward(self) -> float:
        return float(str(self.last) == self.answer)


def environment_entry() -> str:
    """The ``environment_factory`` entry naming :class:`Calculator`."""
    return f"{Path(__file__).resolve()}:Calculator"


def tool_entry() -> str:
    """The ``tools:`` entry naming :func:`multiply`."""
    return f"{Path(__file__).resolve()}:multiply"


def pairs(count: int, seed: int, digits: int = 2) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(count)]


def question(a: int, b: int) -> dict[str, str]:
    return {"role": "user", "content": f"{a}*{b}"}


def tool_call_row(a: int, b: int) -> dict[str, Any]:
    """An SFT row: the call, the tool's answer, the answer copied."""
    from transformers.utils import get_json_schema

    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return {
        "messages": [
            question(a, b),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ],
        "tools": [get_json_schema(multiply)],
    }


def direct_row(a: int, b: int, offered: bool = False) -> dict[str, Any]:
    """An SFT row answering from the model's own arithmetic (``offered``: with the tool in the prompt, not
    called)."""
    row: dict[str, Any] = {"messages": [question(a, b), {"role": "assistant", "content": str(a * b)}]}
    if offered:
        from transformers.utils import get_json_schema

        row["tools"] = [get_json_schema(multiply)]
    return row


def distinct_pairs(sizes: list[int], seed: int, digits: int = 2) -> list[list[tuple[int, int]]]:
    """Sets of the given sizes of pairs of ``digits``-digit numbers, no pair (in either order) in two sets or
    twice in one."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    every = [(a, b) for a in range(low, high + 1) for b in range(a, high + 1)]
    if sum(sizes) > len(every):
        raise ValueError(f"{sum(sizes)} distinct pairs asked, {len(every)} exist")
    chosen = rng.sample(every, sum(sizes))
    chosen = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in chosen]  # both orders asked
    out, start = [], 0
    for size in sizes:
        out.append(chosen[start : start + size])
        start += size
    return out


def prompt_row(a: int, b: int) -> dict[str, Any]:
    return {"prompt": [question(a, b)], "answer": str(a * b)}


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
