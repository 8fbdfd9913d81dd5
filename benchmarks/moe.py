"""Mixture-of-experts speed and memory of ``posttrain train``, every figure against a baseline measured in the
same run (alternating rounds, fresh processes).

The model is a Qwen3-MoE built locally: hidden 512, 4 layers, 32 experts of width 512 per layer, 2 per token
(106.0M parameters, 100.7M of them experts), vocabulary 2,048, float32; chat samples of 100 to 500 tokens,
micro batch 4, ``max_length`` 512, posttrain's defaults otherwise (activation checkpointing, ZeRO stage 0 on one
process).

Works (``--work``):

- ``grouped``: one process, the grouped implementation (``arctic_moe: true``: transformers' grouped-matmul
  experts forward, ``grouped_mm``, which the expert-parallel dispatch wraps; over a group of one there is
  nothing to dispatch) against the Hugging Face module's per-expert loop (``model.experts_implementation:
  eager``, what transformers 4 ran): tokens per second. transformers 5 already defaults to ``grouped_mm``, so
  ``arctic_moe: false`` with its default runs the same kernel.
- ``ep``: two processes (gloo), ``expert_parallel_size: 2`` against 1 under ZeRO stage 0 (so the sharding
  is expert parallelism's alone: with ZeRO 2 the optimizer state is partitioned either way): tokens per
  second per process and the peak resident memory of rank 0 (the metrics' ``memory_rss_gib``).

A round's figure is the median over the steps after the warm-up steps (``step_time.timing``); the ratio is
taken between the medians over rounds. Run: ``python benchmarks/moe.py [--steps 12 --rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


from step_time import MICRO_BATCH, history_timing, long_rows, posttrain_cli, run_facts, user_config

HIDDEN, LAYERS, EXPERTS, TOP_K = 512, 4, 32, 2
WORKS = ("grouped", "ep")


def prepare(work: Path, steps: int) -> dict[str, int]:
    from posttrain.testing.data import write_jsonl
    from posttrain.tiny_model import write_tiny_model

    if not (work / "model").exists():
        write_tiny_model(
            work / "model",
            hidden_size=HIDDEN,
            layers=LAYERS,
            vocab_size=2048,
            arch="qwen3_moe",
            experts=EXPERTS,
        )
    write_jsonl(work / "data.jsonl", long_rows(MICRO_BATCH * 2 * (steps + 2) * 3))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work / "model")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"parameters": sum(p.numel() for p in model.parameters()), "expert_parameters": experts}


def measure(work: Path, config: dict[str, Any], nproc: int) -> dict[str, float]:
    records = [r for r in posttrain_cli(work, config, nproc) if "loss" in r]
    timing = history_timing(records)
    return {
        "tokens_per_s_per_process": timing.tokens_per_s / nproc,
        "step_s": timing.step_s,
        "rss_gib": max(r.get("memory_rss_gib", 0.0) for r in records),
        "final_loss": timing.final_loss,
    }


def alternate(work: Path, sides: dict[str, dict[str, Any]], nproc: int, count: int) -> dict[str, Any]:
    """Each side ``count`` times, alternating; per-side medians and every round."""
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for index in range(count):
        for side, config in sides.items():
            rounds[side].append(measure(work, config, nproc))
        print(
            f"round {index + 1}: "
            + ", ".join(
                f"{side} {r[-1]['tokens_per_s_per_process']:.1f} tok/s/process, {r[-1]['rss_gib']:.2f} GiB, "
                f"loss {r[-1]['final_loss']:.4f}"
                for side, r in rounds.items()
            ),
            flush=True,
        )
    return {
        side: {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"rounds": runs}
        for side, runs in rounds.items()
    }


def work_grouped(work: Path, args: Any) -> dict[str, Any]:
    base = user_config(work, args.steps)
    eager = {**base, "model": {**base["model"], "experts_implementation": "eager"}}
    sides = {"hf-eager": eager, "grouped": {**base, "arctic_moe": True}}
    result = alternate(work, sides, 1, args.rounds)
    ratio = result["grouped"]["tokens_per_s_per_process"] / result["hf-eager"]["tokens_per_s_per_process"]
    print(f"grouped / Hugging Face per-expert loop: {ratio:.2f}x tokens/s")
    return {**result, "tokens_per_s_ratio": ratio}


def work_ep(work: Path, args: Any, sizes: dict[str, int]) -> dict[str, Any]:
    base = user_config(work, args.steps, **{"deepspeed.zero_optimization.stage": 0})
    sides = {"ep1": base, "ep2": {**base, "expert_parallel_size": 2}}
    result = alternate(work, sides, 2, args.rounds)
    ep1, ep2 = result["ep1"], result["ep2"]
    ratio = ep2["tokens_per_s_per_process"] / ep1["tokens_per_s_per_process"]
    share = sizes["expert_parameters"] / sizes["parameters"]
    print(
        f"EP=2 / EP=1 per process: {ratio:.2f}x tokens/s, rank 0 peak RSS {ep2['rss_gib']:.2f} vs "
        f"{ep1['rss_gib']:.2f} GiB (experts are {share:.0%} of the parameters; EP=2 holds half of them)"
    )
    return {**result, "tokens_per_s_ratio": ratio, "rss_saved_gib": ep1["rss_gib"] - ep2["rss_gib"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", nargs="+", default=list(WORKS), choices=WORKS)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a new temporary one)"
    )
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="posttrain-moe-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = prepare(work, args.steps)
    summary: dict[str, Any] = {**sizes, **run_facts(args)}
    for name in args.work:
        summary[name] = work_grouped(work, args) if name == "grouped" else work_ep(work, args, sizes)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
