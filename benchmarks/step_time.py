"""Time per optimizer step: ``posttrain train`` against a bare PyTorch loop, measured in one run.

Same model (an ~8M-parameter LLaMA built locally), same samples in the same order, same micro batch, same
optimizer (torch AdamW, gradient clipping 1.0), one process on the CPU. Each side runs several rounds,
alternating; the figure per round is the median wall-clock time between consecutive step ends (so data
loading and all per-step bookkeeping count), and the ratio is taken between the medians over rounds.

Run: ``make bench`` (or ``python benchmarks/step_time.py [--steps 30 --rounds 3]``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from posttrain.config import load_config
from posttrain.context import RunContext
from posttrain.data.cache import load_datasets
from posttrain.data.collate import Collator
from posttrain.dist import init_distributed
from posttrain.methods.sft import sft_loss
from posttrain.optim.adamw import param_groups
from posttrain.run import run
from posttrain.testing.data import write_jsonl
from posttrain.testing.tiny import write_tiny_model

MICRO_BATCH = 4
MAX_LENGTH = 512


def long_rows(n: int, seed: int = 0) -> list[dict]:
    """Chat rows of 100 to 500 tokens, like short real SFT samples."""
    import random

    rng = random.Random(seed)
    words = "the model learns to answer questions about data and code with short clear sentences".split()
    rows = []
    for _ in range(n):
        question = " ".join(rng.choices(words, k=rng.randint(20, 120)))
        answer = " ".join(rng.choices(words, k=rng.randint(20, 250)))
        rows.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        )
    return rows


def median_step(ends: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(ends[1:])]  # skip the first (warm-up) step
    return statistics.median(gaps)


def bare_loop(config, steps: int) -> float:
    """The baseline: a plain PyTorch training loop over the same batches."""
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.name_or_path)
    ctx = RunContext(config, init_distributed())
    data = load_datasets(ctx, tokenizer, MAX_LENGTH)
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=config.data.seed)
    loader = DataLoader(
        data.train, batch_size=MICRO_BATCH, sampler=sampler, collate_fn=Collator(tokenizer.pad_token_id)
    )
    model = AutoModelForCausalLM.from_pretrained(
        config.model.name_or_path, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(
        param_groups(model, config.optimizer.weight_decay, config.optimizer.lr),
        lr=config.optimizer.lr,
        foreach=True,
    )
    ends = [time.time()]
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss, _ = sft_loss(model, batch)
        (loss / batch["num_target_tokens"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # the loop logs the loss each step, as posttrain does
        ends.append(time.time())
    return median_step(ends)


def posttrain_loop(config) -> float:
    result = run(config)
    return median_step([result.state.history[0]["time"] - 1.0] + [h["time"] for h in result.state.history])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    model_dir = write_tiny_model(work / "model", hidden_size=256, layers=6, vocab_size=2048, seed=0)
    data = write_jsonl(work / "data.jsonl", long_rows(MICRO_BATCH * (args.steps + 2)))
    config = load_config(
        data={
            "model": {
                "name_or_path": str(model_dir),
                "dtype": "float32",
                "disable_activation_checkpoint": True,
            },
            "data": {"sources": [str(data)], "max_length": MAX_LENGTH, "dl_num_workers": 0},
            "micro_batch_size": MICRO_BATCH,
            "train_iters": args.steps,
            "optimizer": {"lr": 1e-4},
            "scheduler": {"name": "constant", "warmup_ratio": 0},
            "logger": {"output_dir": str(work / "run")},
            "loss_log_interval": 0,
        }
    )
    params = sum(
        p.numel()
        for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters()
    )
    bare, ours = [], []
    for round_index in range(args.rounds):
        bare.append(bare_loop(config, args.steps))
        ours.append(posttrain_loop(config))
        print(
            f"round {round_index + 1}: bare {bare[-1] * 1000:.1f} ms/step, posttrain {ours[-1] * 1000:.1f} ms/step",
            flush=True,
        )
    b, o = statistics.median(bare), statistics.median(ours)
    summary = {
        "model_parameters": params,
        "micro_batch_size": MICRO_BATCH,
        "max_length": MAX_LENGTH,
        "bare_ms_per_step": round(b * 1000, 1),
        "posttrain_ms_per_step": round(o * 1000, 1),
        "ratio": round(o / b, 3),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
    }
    print(json.dumps(summary, indent=2))
    print(f"posttrain / bare PyTorch time per step: {o / b:.3f} (goal <= 1.10)")


if __name__ == "__main__":
    main()
