"""A 2B vision-language model on a GPU: SFT in bf16 on image rows, its steps per second and image rows per
second, and its peak memory against the memory plan (within 20%). The model is the tiny builder's Idefics3
(SmolVLM's architecture) at 2.0B (hidden 2048, 32 layers; random weights: nothing is downloaded)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from posttrain.testing.data import write_jsonl
from posttrain.testing.vision import colour_rows

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_a_2b_vlm_trains_in_bf16_within_its_memory_plan(tmp_path: Path) -> None:
    from posttrain.vision.tiny import write_tiny_vlm

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_plan import estimate, measure  # the memory-plan benchmark's own two halves

    model = write_tiny_vlm(tmp_path / "vlm", "idefics3", hidden_size=2048, layers=32, heads=16)
    write_jsonl(tmp_path / "train.jsonl", colour_rows(tmp_path, 512, seed=1))
    config = {
        "type": "sft",
        "model": {"name_or_path": str(model), "dtype": "bfloat16", "freeze_multi_modal_projector": False},
        "data": {"sources": [str(tmp_path / "train.jsonl")], "max_length": 64},
        "micro_batch_size": 32,
        "train_iters": 12,
        "optimizer": {"lr": 1e-5},
        "logger": {"output_dir": str(tmp_path / "run")},
    }
    peak = measure(config)
    planned, _ = estimate(config, 1)
    lines = [json.loads(x) for x in (tmp_path / "run" / "train-log-metrics.jsonl").read_text().splitlines()]
    timed = [x for x in lines if "step_time" in x][2:]
    seconds = sum(x["step_time"] for x in timed)
    report = {
        "steps_per_second": len(timed) / seconds,
        "image_rows_per_second": 32 * len(timed) / seconds,
        "peak_gib": peak / 2**30,
        "plan_gib": planned / 2**30,
        "plan_error": planned / peak - 1,
    }
    print("vision-gpu " + json.dumps(report))
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert abs(report["plan_error"]) <= 0.20, report
