"""Long completions online: one process's peak memory in an online step at sequence parallelism 1 and 2, and
the longest completion the memory plan fits in this machine's memory at each.

    python benchmarks/online_long.py                       # on-policy distillation, 8,192-token completions
    python benchmarks/online_long.py --method grpo         # a GRPO step with a reference
    python benchmarks/online_long.py --length 16384

The completions' length is set, not sampled: ``distill`` trains on the data's completions (``lmbda: 0``: GKD's
supervised batches; the student's forward and backward, the teacher's forward), ``grpo`` on the completions a
``rollout_func`` returns (TRL's hand-written rollout: ``--length`` tokens for each, rewards that differ inside
the group; the policy's forward and backward, the reference's forward, ``beta`` 0.04). One completion a
micro-batch, tiled log-probabilities and activation checkpointing on. Each run measures the growth of a fresh
process's peak resident memory over its memory before the run (``benchmarks/memory_plan.py``'s measurement;
the larger rank at SP=2), against the plan's estimate for the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import memory_plan

GIB = 2**30


#: GRPO's rollout: every completion ``LENGTH`` tokens of the prompt's own digits, a reward from its index
ROLLOUT = """
LENGTH = {length}

def rollout(prompts, trainer):
    tokenizer = trainer.tokenizer
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    digits = tokenizer(" ".join(str(k % 10) for k in range(LENGTH)))["input_ids"][:LENGTH]
    return {{"prompt_ids": ids, "completion_ids": [digits] * len(ids), "logprobs": None,
             "slot": list(range(len(ids)))}}

def by_slot(completions, slot, **kwargs):
    return [float(s % 2) for s in slot]
"""


def write_inputs(
    work: Path,
    length: int,
    hidden: int,
    layers: int,
    method: str = "distill",
    heads: int = 4,
    vocab_size: int = 2048,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The run's config: its model written once under ``work``, its rows' completions ``length`` tokens."""
    from posttrain.testing.data import write_jsonl
    from posttrain.tiny_model import write_tiny_model

    model = work / f"model-{hidden}-{layers}-{heads}-{vocab_size}"
    if not model.exists():
        write_tiny_model(model, hidden_size=hidden, layers=layers, heads=heads, vocab_size=vocab_size)
    # about one token a number: "1 2 3 ..." in the tiny tokenizer
    rows = [
        {"prompt": f"count from {i}", "completion": " ".join(str(k % 10) for k in range(length))}
        for i in range(8)
    ]
    data = write_jsonl(work / f"long-{length}.jsonl", rows)
    common = {
        "model": {"name_or_path": str(model), "dtype": dtype, "disable_activation_checkpoint": False},
        "data": {"sources": [str(data)], "max_length": 64, "dl_num_workers": 0},
        "max_completion_length": length,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "train_iters": 1,
        "tiled_loss_compute": True,
        "optimizer": {"lr": 1e-4},
        "loss_log_interval": 1,
        "checkpoint": [],
        "check_memory": False,
    }
    if method == "grpo":
        code = work / f"rollout-{length}.py"
        code.write_text(ROLLOUT.format(length=length))
        return {
            "type": "grpo",
            **common,
            "rollout_func": f"{code}:rollout",
            "rewards": [f"{code}:by_slot"],
            "num_generations": 2,
            "beta": 0.04,
            "log_completions": False,
        }
    return {"type": "distill", **common, "teacher_model_name_or_path": str(model), "lmbda": 0.0, "beta": 0.0}


def longest_fitting(config: dict[str, Any], processes: int, memory: float) -> int:
    """The longest completion (a power of two from 1K) whose plan fits ``memory`` bytes for all processes."""
    from posttrain.memory.machine import Machine

    machine = Machine("cpu", None, memory, processes, "this host")
    fits, length = 0, 1024
    while length <= 2**22:
        _, plan = memory_plan.estimate({**config, "max_completion_length": length}, processes, machine)
        if plan.host_peak * processes > memory:
            break
        fits, length = length, length * 2
    return fits


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", choices=("distill", "grpo"), default="distill")
    parser.add_argument("--length", type=int, default=8192, help="completion tokens")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = args.work or Path(tempfile.mkdtemp(prefix="online-long-"))
    memory_plan.prepare(work)  # the warm-up run's model and data
    base = write_inputs(work, args.length, args.hidden, args.layers, args.method)
    from posttrain.memory.machine import detect

    host = detect(1).host_memory
    rows = []
    for sp in (1, 2):
        config = {**base, "sequence_parallel_size": sp, "logger": {"output_dir": str(work / f"run-sp{sp}")}}
        estimate, _ = memory_plan.estimate(config, sp)
        measured = memory_plan.run_measured(config, sp, work)
        rows.append(
            {
                "method": args.method,
                "sequence_parallel_size": sp,
                "completion_tokens": args.length,
                "measured_bytes_per_process": measured,
                "estimate_bytes_per_process": estimate,
                "longest_fitting_completion": longest_fitting(config, sp, host),
            }
        )
        print(
            f"{args.method} SP={sp}: {args.length:,}-token completions, peak per process {measured / GIB:.2f} GiB (plan "
            f"{estimate / GIB:.2f} GiB, {estimate / measured - 1:+.1%}); the plan's longest completion in "
            f"{host / GIB:.0f} GiB: {rows[-1]['longest_fitting_completion']:,} tokens",
            flush=True,
        )
    ratio = rows[0]["measured_bytes_per_process"] / rows[1]["measured_bytes_per_process"]
    print(f"SP=1 / SP=2 peak per process: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
