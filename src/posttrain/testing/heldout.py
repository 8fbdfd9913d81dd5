"""The demos' check that a held-out set holds nothing trained on: the questions of a JSONL file (a prompt, or
the first user message of a chat) compared with those of every training file, before anything trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def question(row: dict[str, Any]) -> str:
    """A row's question: its text prompt, or the first user message of its prompt or chat."""
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        for message in prompt:
            if isinstance(message, dict) and message.get("role") == "user":
                return str(message.get("content"))
    raise ValueError(f"a row without a prompt or a user message: {str(row)[:120]}")


def questions(path: Path) -> list[str]:
    return [question(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def check_disjoint(held_out: Path, training: list[Path]) -> str:
    """A line saying the held-out questions are none of the training files'; SystemExit naming the shared
    questions otherwise."""
    held = questions(held_out)
    seen: set[str] = set()
    for path in training:
        seen.update(questions(path))
    shared = sorted(set(held) & seen)
    if shared:
        raise SystemExit(
            f"{held_out}: {len(shared)} of its {len(held)} held-out questions are in the training sets "
            f"({', '.join(str(p) for p in training)}), e.g. {shared[:3]}: the accuracy would not be held-out"
        )
    return (
        f"held-out: {len(held)} questions ({held_out.name}), none among the {len(seen)} of "
        f"{', '.join(p.name for p in training)} (checked)"
    )
