"""Speed of ``posttrain train`` against a hand-written PyTorch loop on the same work, measured in one run.

The work is what a user runs by default: posttrain's defaults (ZeRO as chosen for the world size, activation
checkpointing on, the linear schedule with 10% warmup, gradient clipping 1.0, a log line every step) with
``model.dtype: float32`` (this CPU has no bf16 instructions), an ~8.4M-parameter LLaMA built locally (hidden
256, 8 layers, vocabulary 2,048), chat samples of 100 to 500 tokens, micro batch 4, ``max_length`` 512, one
process unless stated. The bare loop reads the same batches in the same order (the same tokenized cache and
shard order) and does the same arithmetic: checkpointed decoder layers, torch AdamW with the same parameter
groups, the same schedule and clipping, the loss summed over target tokens / target tokens, and it reads the
loss on the host every step. Both reach the same final loss (printed, to 4 decimals).

Works (``--work``; several may be given, ``all`` runs every one):

- ``default``: time per optimizer step, posttrain defaults / bare loop.
- ``zero2``: the same with ``deepspeed.zero_optimization.stage: 2`` (ArcticTraining's default stage).
- ``compile``: ``model.compile: true`` against the bare *eager* loop, after warm-up; the compile time apart.
- ``padding-free``: ``data.padding_free: true`` against the padded run: real (non-pad) tokens per second.
- ``startup``: seconds from process start to the first step, ``posttrain train`` CLI against the bare loop
  as a script, each in a fresh process.
- ``two-process``: two CPU processes (gloo), posttrain against a hand-written DistributedDataParallel loop:
  time per sample at two processes over time per sample at one, for each.

Each work runs several rounds, alternating posttrain and the baseline; a round's figure is the median of the
wall-clock gaps between consecutive step ends after the warm-up steps (data loading and every per-step
bookkeeping count), and the ratio is taken between the medians over rounds. The machine is noisy (single
rounds vary by several percent), so compare medians.

Run: ``make bench`` (or ``python benchmarks/step_time.py --work all [--steps 30 --rounds 3]``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import yaml

MICRO_BATCH = 4
MAX_LENGTH = 512
WARMUP_STEPS = 3  # step gaps left out of the median (first allocations; compilation)
WORKS = ("default", "zero2", "compile", "padding-free", "startup", "two-process")


@dataclass
class Timing:
    step_s: float  # median seconds per optimizer step after warm-up
    final_loss: float
    tokens: int  # real (non-pad) input tokens over the measured steps
    measured_s: float  # seconds over the measured steps
    first_step_s: float = 0.0  # the first step (compilation shows here)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.measured_s


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


def timing(ends: list[float], tokens: list[int], losses: list[float]) -> Timing:
    """``ends[0]`` is when the first step started; ``ends[i]`` when step i ended."""
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    measured = gaps[WARMUP_STEPS:]
    return Timing(
        step_s=statistics.median(measured),
        final_loss=losses[-1],
        tokens=sum(tokens[WARMUP_STEPS:]),
        measured_s=sum(measured),
        first_step_s=gaps[0],
    )


def user_config(work: Path, steps: int, **overrides: Any) -> dict[str, Any]:
    """What a user writes: model, data, batch, steps, learning rate; everything else is posttrain's default."""
    config: dict[str, Any] = {
        "model": {"name_or_path": str(work / "model"), "dtype": "float32"},
        "data": {"sources": [str(work / "data.jsonl")], "max_length": MAX_LENGTH},
        "micro_batch_size": MICRO_BATCH,
        "train_iters": steps,
        "optimizer": {"lr": 1e-4},
        "logger": {"output_dir": str(work / "run")},
    }
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return config


def bare(config_data: dict[str, Any], steps: int) -> Timing:
    """The baseline: the hand-written loop of ``posttrain.testing.bare_loop`` over the same batches."""
    from posttrain.config import load_config
    from posttrain.testing.bare_loop import bare_loop

    result = bare_loop(load_config(data=config_data), steps)
    return timing(result.ends, result.tokens, result.losses)


# -------------------------------------------------------------------------------------------- posttrain


def posttrain_loop(config_data: dict[str, Any]) -> Timing:
    from posttrain.config import load_config
    from posttrain.run import run

    return history_timing(run(load_config(data=config_data)).state.history)


def history_timing(history: list[dict[str, Any]]) -> Timing:
    """A ``Timing`` from posttrain's step records (eval-only records left out)."""
    steps = [h for h in history if "loss" in h]
    ends = [steps[0]["time"] - steps[0]["step_time"], *(h["time"] for h in steps)]
    return timing(ends, [h["tokens_per_second"] * h["step_time"] for h in steps], [h["loss"] for h in steps])


def rounds(name: str, count: int, sides: dict[str, Any]) -> dict[str, list[Timing]]:
    """Run each side ``count`` times, alternating; print each round."""
    results: dict[str, list[Timing]] = {side: [] for side in sides}
    for index in range(count):
        for side, call in sides.items():
            results[side].append(call())
        print(
            f"{name} round {index + 1}: "
            + ", ".join(
                f"{side} {r[-1].step_s * 1000:.1f} ms/step (loss {r[-1].final_loss:.4f})"
                for side, r in results.items()
            ),
            flush=True,
        )
    return results


def median(timings: list[Timing], attribute: str = "step_s") -> float:
    return statistics.median(getattr(t, attribute) for t in timings)


def compare(name: str, baseline: dict[str, Any], ours: dict[str, Any], args: Any) -> dict[str, Any]:
    """Time per step of posttrain on ``ours`` against the bare loop on ``baseline``, in alternating rounds."""
    result = rounds(
        name,
        args.rounds,
        {"bare": lambda: bare(baseline, args.steps), "posttrain": lambda: posttrain_loop(ours)},
    )
    base, mine = median(result["bare"]), median(result["posttrain"])
    return {
        "bare_ms_per_step": round(base * 1000, 1),
        "posttrain_ms_per_step": round(mine * 1000, 1),
        "ratio": round(mine / base, 3),
        "round_ratios": [
            round(o.step_s / b.step_s, 3) for o, b in zip(result["posttrain"], result["bare"], strict=True)
        ],
        "final_loss": {side: round(r[-1].final_loss, 4) for side, r in result.items()},
        "posttrain_first_steps_s": [round(t.first_step_s, 1) for t in result["posttrain"]],
    }


def work_default(work: Path, args: Any, **overrides: Any) -> dict[str, Any]:
    config = user_config(work, args.steps, **overrides)
    return compare("zero2" if overrides else "default", config, config, args)


def work_compile(work: Path, args: Any) -> dict[str, Any]:
    """``model.compile: true`` against the bare eager loop; the compilation shows in the first step of each
    round (the first round compiles, later ones find inductor's cache warm)."""
    compiled = user_config(work, args.steps, **{"model.compile": True})
    return compare("compile", user_config(work, args.steps), compiled, args)


def work_padding_free(work: Path, args: Any) -> dict[str, Any]:
    """Real tokens per second: padding-free against padded posttrain and the bare (padded) loop."""
    padded = user_config(work, args.steps)
    flat = user_config(work, args.steps, **{"data.padding_free": True})
    result = rounds(
        "padding-free",
        args.rounds,
        {
            "bare": lambda: bare(padded, args.steps),
            "padded": lambda: posttrain_loop(padded),
            "padding_free": lambda: posttrain_loop(flat),
        },
    )
    speed = {side: statistics.median(t.tokens_per_s for t in r) for side, r in result.items()}
    return {
        "tokens_per_s": {side: round(v, 1) for side, v in speed.items()},
        "padding_free_over_padded": round(speed["padding_free"] / speed["padded"], 3),
        "padding_free_over_bare": round(speed["padding_free"] / speed["bare"], 3),
        "final_loss": {side: round(r[-1].final_loss, 4) for side, r in result.items()},
    }


def _fresh(command: list[str]) -> subprocess.CompletedProcess:
    """Run ``command`` without the distributed variables this process set for its own process group."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in names}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{command[:6]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def posttrain_cli(work: Path, config: dict[str, Any], nproc: int = 1) -> list[dict[str, Any]]:
    """``posttrain train`` in a fresh process (``--nproc`` processes); its metrics records."""
    path = work / f"cli-{nproc}.yaml"
    path.write_text(yaml.safe_dump(config))
    metrics = Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"
    metrics.unlink(missing_ok=True)
    _fresh([sys.executable, "-m", "posttrain", "train", str(path), "--nproc", str(nproc)])
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _startup_posttrain(work: Path, config: dict[str, Any]) -> float:
    started = time.time()
    first = posttrain_cli(work, config)[0]
    return first["time"] - first["step_time"] - started


BARE_SCRIPT = """
import json, sys, time
from posttrain.config import load_config
from posttrain.testing.bare_loop import bare_loop
run = bare_loop(load_config(data=json.loads(sys.argv[1])), 2)
print(run.ends[0])
"""


def _startup_bare(config: dict[str, Any]) -> float:
    started = time.time()
    done = _fresh([sys.executable, "-c", BARE_SCRIPT, json.dumps(config)])
    return float(done.stdout.strip().splitlines()[-1]) - started


def work_startup(work: Path, args: Any) -> dict[str, Any]:
    """Seconds from process start to the first step (cache already built), each side in a fresh process."""
    config = user_config(work, 2)
    posttrain_loop(user_config(work, WARMUP_STEPS + 2))  # builds the data cache both sides open
    bare_s, ours = [], []
    for index in range(args.rounds):
        bare_s.append(_startup_bare(config))
        ours.append(_startup_posttrain(work, config))
        print(f"startup round {index + 1}: bare {bare_s[-1]:.2f} s, posttrain {ours[-1]:.2f} s", flush=True)
    b, o = statistics.median(bare_s), statistics.median(ours)
    return {"bare_s": round(b, 2), "posttrain_s": round(o, 2), "difference_s": round(o - b, 2)}


DDP_SCRIPT = """
import itertools, json, os, sys, time
import torch, torch.distributed as dist
from posttrain.config import load_config
from posttrain.testing import bare_loop as bl
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = load_config(data=json.loads(sys.argv[1]))
steps = int(sys.argv[2])
batches = bl.bare_batches(config, rank, world)
model = torch.nn.parallel.DistributedDataParallel(bl.bare_model(config))
optimizer, scheduler = bl.bare_optimizer(model.module, config, steps)
ends = [time.time()]
for batch in itertools.islice(batches, steps):
    counts = torch.tensor([float(batch["num_target_tokens"])])
    dist.all_reduce(counts)
    loss = bl.bare_step(model, batch, optimizer, scheduler, 1.0, units=float(counts[0]) / world)
    dist.all_reduce(torch.tensor([loss]))  # the logged loss, over all ranks (as posttrain logs it)
    ends.append(time.time())
if rank == 0:
    print(json.dumps(ends))
dist.destroy_process_group()
"""


def _ddp(config: dict[str, Any], steps: int, nproc: int) -> float:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    done = _fresh([*command, "--no-python", sys.executable, "-c", DDP_SCRIPT, json.dumps(config), str(steps)])
    ends = json.loads(done.stdout.strip().splitlines()[-1])
    return timing(ends, [0] * (len(ends) - 1), [0.0] * (len(ends) - 1)).step_s


def work_two_process(work: Path, args: Any) -> dict[str, Any]:
    """Per-sample time at two processes over one process, for posttrain and a hand-written DDP loop."""
    config = user_config(work, args.steps)
    posttrain_loop(config)  # the data cache
    runs: dict[str, list[float]] = {"ddp1": [], "ddp2": [], "posttrain1": [], "posttrain2": []}
    for index in range(args.rounds):
        for nproc in (1, 2):
            runs[f"ddp{nproc}"].append(_ddp(config, args.steps, nproc))
            runs[f"posttrain{nproc}"].append(history_timing(posttrain_cli(work, config, nproc)).step_s)
        print(
            f"two-process round {index + 1}: "
            + ", ".join(f"{k} {v[-1] * 1000:.0f} ms/step" for k, v in runs.items()),
            flush=True,
        )
    step = {k: statistics.median(v) for k, v in runs.items()}
    # per-sample time: a step of n processes holds n micro-batches
    ddp_scaling = step["ddp2"] / 2 / step["ddp1"]
    ours_scaling = step["posttrain2"] / 2 / step["posttrain1"]
    return {
        "ms_per_step": {k: round(v * 1000, 1) for k, v in step.items()},
        "ddp_per_sample_2_over_1": round(ddp_scaling, 3),
        "posttrain_per_sample_2_over_1": round(ours_scaling, 3),
        "posttrain_over_ddp_at_2": round(step["posttrain2"] / step["ddp2"], 3),
    }


def prepare(work: Path, steps: int) -> int:
    from posttrain.testing.data import write_jsonl
    from posttrain.tiny_model import write_tiny_model

    if not (work / "model").exists():
        write_tiny_model(work / "model", hidden_size=256, layers=8, vocab_size=2048, seed=0)
    write_jsonl(work / "data.jsonl", long_rows(MICRO_BATCH * (steps + 2) * 3))
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(work / "model").parameters())


WORK_FUNCTIONS = {
    "compile": work_compile,
    "padding-free": work_padding_free,
    "startup": work_startup,
    "two-process": work_two_process,
}


def run_facts(args: Any) -> dict[str, Any]:
    """What a benchmark summary states about its work and machine."""
    return {
        "micro_batch_size": MICRO_BATCH,
        "max_length": MAX_LENGTH,
        "steps": args.steps,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", nargs="+", default=["default", "zero2"], choices=[*WORKS, "all"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a new temporary one)"
    )
    args = parser.parse_args()
    works = WORKS if "all" in args.work else args.work
    work = args.dir or Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"model_parameters": prepare(work, args.steps), **run_facts(args)}
    for name in works:
        if name == "default":
            summary[name] = work_default(work, args)
        elif name == "zero2":
            summary[name] = work_default(work, args, **{"deepspeed.zero_optimization.stage": 2})
        else:
            summary[name] = WORK_FUNCTIONS[name](work, args)
        print(json.dumps({name: summary[name]}), flush=True)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
