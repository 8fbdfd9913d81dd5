"""Helpers for integration tests: run a real training from a config dict in this process."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from posttrain.config import load_config
from posttrain.run import RunResult, run


def merge(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """Deep-merge keyword changes (nested dicts merge, other values replace)."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], **value)
        else:
            out[key] = value
    return out


def train(config: dict[str, Any], base_dir: Path | None = None) -> RunResult:
    # The process group stays up between runs in one test process (world size 1), as DeepSpeed caches it.
    return run(load_config(data=config, base_dir=base_dir))


def metrics(config: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """On the CPU, whatever device the run trained on (so runs and reloaded checkpoints compare)."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
