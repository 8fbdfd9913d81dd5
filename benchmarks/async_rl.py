"""Generation ahead of training (``max_staleness``): the same GRPO work with a ``posttrain vllm-serve`` server on
its own cores and the trainer on the others, synchronous against ``max_staleness`` 1 and 2, and the best
synchronous layout on all the cores (vLLM colocated in the trainer, and transformers' ``generate``), measured in
one run.

    .venv-vllm/bin/python benchmarks/async_rl.py [--steps 14] [--completion 64] [--lags 1,2] [--json out.json]

Needs vLLM (its CPU build here: ``make vllm-env`` makes ``.venv-vllm``). The work: a random LLaMA written locally
(hidden 128, 4 layers, 4 heads of 32, vocabulary 4,096), float32; 8 prompts ``reverse <digits>`` per step, 8
completions each (64, micro-batch 32 x accumulation 2), completions of ``--completion`` tokens (64; a random
model never stops early) at temperature 1, the share of digit characters as the reward, AdamW at a constant lr
1e-5, loss ``dapo`` with TRL's importance-sampling correction (on, its default).

The split: the server's threads on the first half of the cores (``--cores``), the trainer on the rest
(``taskset`` and as many torch threads). One server serves every split run: each run pushes its weights before
it generates. The step time is the median gap between step ends after two warm-up steps; the waits are the
trainer's for generation and the generator's for weights, per step (``time_waiting_generation``,
``time_waiting_weights``). The last line is ``async/sync step time: X.XX``: ``max_staleness: 1`` against the
synchronous run on the same split (the issue's goal: at most 0.60).

On GPUs (not measured here): the trainer on its GPUs (``posttrain train`` under ``deepspeed``) and the server on
others (``CUDA_VISIBLE_DEVICES`` for ``posttrain vllm-serve``, ``vllm_server_host``/``_port`` in the config);
the weights then reach the server through NCCL rather than the files used on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # grpo_step beside this script

SHAPE = {"hidden_size": 128, "layers": 4, "heads": 4, "vocab_size": 4096}
GROUP, PROMPTS_PER_STEP, MICRO, ACCUMULATION, LR = 8, 8, 32, 2, 1e-5
WARMUP = 2  # steps left out of the step time: compilation, first pushes, the pipeline filling


def environment(threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    env.update(OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu", TRANSFORMERS_VERBOSITY="error")
    return env


def write_inputs(work: Path, steps: int, completion: int) -> dict[str, Any]:
    """The model, the prompts and the reward file, and the run's config (without its layout)."""
    from posttrain.tiny_model import write_tiny_model

    model = write_tiny_model(work / "model", seed=0, **SHAPE)
    rng = random.Random(0)
    prompts = work / "prompts.jsonl"
    with prompts.open("w") as out:
        for _ in range(PROMPTS_PER_STEP * (steps + 4)):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            out.write(json.dumps({"prompt": [{"role": "user", "content": f"reverse {digits}"}]}) + "\n")
    from grpo_step import REWARD_FILE  # the same reward as the GRPO step benchmark

    (work / "reward.py").write_text(REWARD_FILE)
    return {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "float32", "disable_activation_checkpoint": True},
        "data": {"sources": [str(prompts)], "max_length": 80, "dl_num_workers": 0},
        "rewards": [f"{work / 'reward.py'}:digit_share"],
        "num_generations": GROUP,
        "max_completion_length": completion,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "micro_batch_size": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "train_iters": steps,
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        "scheduler": {"name": "constant", "warmup_ratio": 0},
        "log_completions": False,
        "loss_log_interval": 1,
    }


def write_config(work: Path, name: str, config: dict[str, Any]) -> Path:
    import yaml

    shutil.rmtree(work / name, ignore_errors=True)  # its metrics file is appended to
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "logger": {"output_dir": str(work / name)}}))
    return path


def train(work: Path, name: str, config: dict[str, Any], cores: list[int]) -> dict[str, float]:
    """One run of ``posttrain train`` on ``cores``; its step time and per-step means."""
    path = write_config(work, name, config)
    command = [
        "taskset",
        "-c",
        ",".join(map(str, cores)),
        sys.executable,
        "-m",
        "posttrain",
        "train",
        str(path),
    ]
    print(f"  {name}: {len(cores)} core(s) {cores} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env=environment(len(cores)), cwd=work)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    lines = (work / name / "train-log-metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "reward" in r]
    timed = records[WARMUP:]
    ends = [r["time"] for r in records]
    gaps = [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1 :], strict=False)]

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in timed)

    return {
        "step_s": statistics.median(gaps),
        "generation_s": mean("time_generation"),
        "waiting_generation_s": mean("time_waiting_generation"),
        "waiting_weights_s": mean("time_waiting_weights"),
        "staleness": mean("sample/staleness_mean"),
        "reward": statistics.fmean(r["reward"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", type=int, default=14, help="optimizer steps per run (the first two warm up)"
    )
    parser.add_argument("--completion", type=int, default=64, help="max_completion_length (tokens)")
    parser.add_argument("--lags", default="1,2", help="the max_staleness values against the synchronous run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from posttrain.dist import free_port
    from posttrain.generation.vllm_engine import require_vllm, usable_cores
    from posttrain.testing.served import vllm_server

    require_vllm()
    cores = usable_cores()
    if len(cores) < 2:
        sys.exit("needs two cores or more: the server's and the trainer's")
    serving, training = cores[: len(cores) // 2], cores[len(cores) // 2 :]
    lags = [int(x) for x in args.lags.split(",") if x]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="async-rl-") as scratch:
        work = Path(scratch)
        base = write_inputs(work, args.steps, args.completion)
        split = {**base, "use_vllm": True, "vllm_mode": "server", "vllm_server_host": "127.0.0.1"}
        split["vllm_server_port"] = free_port()
        print(f"server on cores {serving}, trainer on {training}", file=sys.stderr, flush=True)
        serve = write_config(work, "serve", split)
        with vllm_server(
            serve, work / "server.log", split["vllm_server_port"], serving, env=environment(len(serving))
        ):
            for lag in [0, *lags]:
                name = "split, synchronous" if lag == 0 else f"split, max_staleness {lag}"
                results[name] = train(work, f"split-{lag}", {**split, "max_staleness": lag}, training)
        results["colocated vLLM, synchronous"] = train(work, "colocated", {**base, "use_vllm": True}, cores)
        results["transformers generate, synchronous"] = train(work, "generate", base, cores)
    synchronous = results["split, synchronous"]["step_s"]
    best = min(v["step_s"] for k, v in results.items() if "synchronous" in k)
    print(f"\n{platform.processor() or platform.machine()}, {len(cores)} cores; {args.steps} steps per run")
    print(
        f"{'layout':38s} {'step s':>7s} {'gen s':>6s} {'wait gen':>8s} {'wait w':>7s} {'stale':>5s} {'x sync':>6s}"
    )
    for name, row in results.items():
        print(
            f"{name:38s} {row['step_s']:7.2f} {row['generation_s']:6.2f} {row['waiting_generation_s']:8.2f} "
            f"{row['waiting_weights_s']:7.2f} {row['staleness']:5.2f} {row['step_s'] / synchronous:6.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cores": cores, "steps": args.steps, "results": results}, indent=1)
        )
    lagged = results.get("split, max_staleness 1", results[next(k for k in results if "max_staleness" in k)])
    print(f"async/best synchronous layout step time: {lagged['step_s'] / best:.2f}")
    print(f"async/sync step time: {lagged['step_s'] / synchronous:.2f}")


if __name__ == "__main__":
    main()
