"""Synthetic chat rows for tests and benchmarks (digit reversal, varied lengths and shapes)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def chat_rows(n: int, seed: int = 0, max_digits: int = 9) -> list[dict]:
    """Rows of varied length; every third has a system message, every fourth a second exchange."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, max_digits)))
        messages = [
            {"role": "user", "content": f"reverse {digits}"},
            {"role": "assistant", "content": digits[::-1]},
        ]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer with digits only."})
        if i % 4 == 0:
            messages += [{"role": "user", "content": "again"}, {"role": "assistant", "content": digits[::-1]}]
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def text_rows(n: int, seed: int = 0) -> list[dict]:
    """Raw-text documents for continued pretraining: counting sequences of varied length (learnable)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.randint(0, 50)
        rows.append({"text": " ".join(str(i) for i in range(start, start + rng.randint(3, 20)))})
    return rows


_DIGIT_WORDS = "zero one two three four five six seven eight nine".split()


def format_preference_rows(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs a tiny random model learns in a few steps (the DPO starter): the reversed digits are
    chosen, the same answer spelled out in words is rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        answer = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8)))[::-1]
        spelled = " ".join(_DIGIT_WORDS[int(c)] for c in answer)
        rows.append({"prompt": f"reverse {answer[::-1]}", "chosen": answer, "rejected": spelled})
    return rows


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs: the reversed digits are chosen, the digits unchanged are rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8)))
        rows.append({"prompt": f"reverse {digits}", "chosen": digits[::-1], "rejected": digits})
    return rows
