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


def test_grpo_on_image_prompts_of_a_2b_vlm_on_the_gpu(tmp_path: Path) -> None:
    """GRPO on the same 2B model's image prompts in bf16 (transformers' ``generate``: vLLM is not in the GPU
    image): steps per second and completions per second, the reward read from the images, the peak memory."""
    import torch

    from posttrain.testing.vision import COLOURS, colour_prompts
    from posttrain.vision.tiny import write_tiny_vlm
    from tests.integration.helpers import metrics, train

    model = write_tiny_vlm(tmp_path / "vlm", "idefics3", hidden_size=2048, layers=32, heads=16)
    write_jsonl(tmp_path / "prompts.jsonl", colour_prompts(tmp_path, 256, seed=1))
    (tmp_path / "sees.py").write_text(
        f"COLOURS = {COLOURS!r}\n"
        "def sees(completions, images, answer, **kwargs):\n"
        "    return [float(COLOURS[a] in [c for _, c in p[0].getcolors()]) + len(t[0]['content']) / 100\n"
        "            for p, a, t in zip(images, answer, completions)]\n"
    )
    config = {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "bfloat16"},
        "data": {"sources": [str(tmp_path / "prompts.jsonl")], "max_length": 64, "dl_num_workers": 0},
        "rewards": [f"{tmp_path / 'sees.py'}:sees"],
        "num_generations": 8,
        "max_completion_length": 32,
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "beta": 0.04,
        "train_iters": 8,
        "optimizer": {"lr": 1e-6},
        "loss_log_interval": 1,
        "logger": {"output_dir": str(tmp_path / "run")},
    }
    torch.cuda.reset_peak_memory_stats()
    train(config)
    records = [r for r in metrics(config) if "reward" in r]
    timed = records[2:]
    seconds = sum(r["step_time"] for r in timed)
    report = {
        "grpo_steps_per_second": len(timed) / seconds,
        "completions_per_second": 32 * len(timed) / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print("vision-grpo-gpu " + json.dumps(report))
    assert len(records) == 8 and all(r["rewards/sees/mean"] >= 1.0 for r in records)  # every image read
