"""The metrics file: one JSON line per optimizer step (and per evaluation), written by rank 0."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFile:
    """Append-only JSON-lines writer, line-buffered so a killed run keeps every finished line."""

    def __init__(self, path: str | Path, enabled: bool) -> None:
        self.path = Path(path)
        self._handle: TextIO | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed by close())

    def write(self, record: dict[str, Any]) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


#: what an online method is judged by on held-out prompts, shown beside ``eval_loss`` (grpo: the rewards of
#: greedy completions; distill: the teacher's divergence from them per token)
JUDGED_BY = ("eval_reward", "eval_divergence")


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_line(record: dict[str, Any], total_steps: int, eta: float | None = None) -> str:
    """A human-readable metrics line for the console (``eta``: seconds left, shown when known)."""
    parts = [f"iter {record['iter']}/{total_steps}", f"epoch {record['epoch']}"]
    shown = (
        ("loss", ".4f"),
        ("reward", ".4f"),
        ("router_aux_loss", ".4f"),
        ("expert_imbalance", ".2f"),
        ("eval_loss", ".4f"),
        *((key, ".4f") for key in JUDGED_BY),
        ("sample/staleness_max", ".0f"),  # generation ahead of training (rollout/ahead.py)
        ("time_waiting_generation", ".2f"),
        ("time_waiting_weights", ".2f"),
        ("lr", ".3e"),
        ("grad_norm", ".3f"),
    )
    for key, fmt in shown:
        if record.get(key) is not None:
            parts.append(f"{key} {record[key]:{fmt}}")
    if record.get("tokens_per_second") is not None:
        parts.append(f"{record['tokens_per_second']:.0f} tok/s")
    if eta is not None:
        parts.append(f"eta {format_duration(eta)}")
    return " | ".join(parts)
