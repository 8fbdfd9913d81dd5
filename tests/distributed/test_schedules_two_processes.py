"""Issues #5 and #6 with two CPU processes: a weighted mix, a total batch size split over the world,
batch-size ramp-up, a Megatron schedule with LR scaling, and capped evaluation give the same run as one
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.integration.helpers import merge, train
from tests.launch_helpers import train_in_two_processes

pytestmark = pytest.mark.distributed


def config_for(base_config: dict, tmp_path: Path, name: str) -> dict:
    chat = base_config["data"]["sources"][0]
    config = merge(
        base_config,
        data={
            "sources": [
                {"name_or_path": chat, "sampling_weight": 1},
                {"name_or_path": chat, "sampling_weight": 2},
            ],
            "mix": "weighted",
            "train_eval_split": [0.75, 0.25],
        },
        total_train_batch_size=16,
        max_per_device_train_batch_size=4,
        rampup_batch_size=[8, 8, 16],
        train_iters=4,
        eval_iters=1,
        # eps=1: Adam's first steps ~ lr * g, so a wrong gradient scale would show (see test_two_processes)
        optimizer={
            "lr": 0.05,
            "eps": 1.0,
            "weight_decay": 0.0,
            "lr_batch_size_scaling": "sqrt",
            "lr_reference_batch_size": 4,
        },
        deepspeed={"gradient_clipping": 0.0},
        logger={"output_dir": str(tmp_path / name)},
        tensorboard={"enable": True},  # issue #6's outputs are rank-aware too
        metrics={"timers": True},
        mem_profiler="step",
        checkpoint=[{"output_dir": str(tmp_path / name / "export"), "save_end_of_training": True}],
    )
    del config["micro_batch_size"]
    config["scheduler"] = {
        "type": "megatron",
        "lr_decay_style": "cosine",
        "lr_warmup_iters": 1,
        "min_lr": 0.01,
    }
    return config


def test_two_processes_match_one(base_config: dict, tmp_path: Path) -> None:
    train(config_for(base_config, tmp_path, "one"))
    train_in_two_processes({"two": config_for(base_config, tmp_path, "two")}, tmp_path)
    lines = {
        name: [json.loads(x) for x in (tmp_path / name / "train-log-metrics.jsonl").read_text().splitlines()]
        for name in ("one", "two")
    }
    one, two = lines["one"], lines["two"]
    assert [x["iter"] for x in one] == [1, 2, 3, 4, 4]  # four steps, then the end-of-training evaluation
    # ramp-up: 8 samples per step for the first 16 samples, then 16 (target tokens grow accordingly)
    assert one[2]["tokens"] > 1.5 * one[0]["tokens"]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "lr", "tokens", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-5), key
    # a one-step warmup to 0.05 x sqrt(16 / 4) (its update runs at the peak, not at 0), then cosine to
    # min_lr 0.01 at step 4
    assert [x["lr"] for x in one[:4]] == pytest.approx([0.1, 0.1, 0.01 + 0.09 * 0.75, 0.01 + 0.09 * 0.25])
    # trackers write once (rank 0); the memory profile is per rank; both ranks' steps were timed
    assert len(list((tmp_path / "two" / "tensorboard").glob("events.out.tfevents.*"))) == 1
    for rank in (0, 1):
        timeline = (tmp_path / "two" / "mem-prof" / f"memory-rank{rank}.jsonl").read_text().splitlines()
        assert len(timeline) == 4
    assert all(x["time_forward"] > 0 for x in two if "loss" in x)
    expected = load_file(tmp_path / "one" / "export" / "final" / "model.safetensors")
    got = load_file(tmp_path / "two" / "export" / "final" / "model.safetensors")
    assert max(float((expected[k] - got[k]).abs().max()) for k in expected) < 1e-5
