"""grpo's dynamic sampling (DAPO) against plain GRPO on the demo's digit-reversal task, whose prompts are of
mixed difficulty for a model SFT left partly right (short numbers solved by every sample, long ones by none):
the held-out exact-match accuracy along the run, the steps and the completions generated to reach it.

    python benchmarks/dynamic_sampling.py                      # 60 steps each, held-out every 10
    python benchmarks/dynamic_sampling.py --steps 100 --target 0.5 --json out.json

Both runs start from the same model (``examples/grpo_demo.py``'s: the SFT demo stopped at step 50) with
``examples/grpo-reverse.yaml``; the second adds ``dynamic_sampling: true``. Printed: each run's accuracy at
every evaluation, the first evaluated step at or above ``--target`` (default: the plain run's best), the
completions each generated until then (the filter's price: its refill rounds) and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def posttrain(*args: str) -> None:
    command = [sys.executable, "-m", "posttrain", *args]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def start_model(work: Path) -> str:
    """The demo's starting point: the tiny model, SFT stopped at step 50 of 160 (partly right)."""
    model, sft = work / "tiny-model", work / "sft-early"
    if not (model / "config.json").is_file():
        posttrain("tiny-model", str(model), "--hidden-size", "128", "--layers", "4", "--seed", "0")
    if not (sft / "checkpoints" / "global_step_50" / "config.json").is_file():
        posttrain(
            "train",
            "examples/sft-reverse.yaml",
            f"model.name_or_path={model}",
            "exit_iteration=50",
            "eval_interval=0",
            f"logger.output_dir={sft}",
            f"checkpoint.0.output_dir={sft}/checkpoints",
        )
    return str(sft / "checkpoints" / "global_step_50")


def grpo(work: Path, model: str, name: str, steps: int, every: int, dynamic: bool) -> dict[str, Any]:
    out = work / name
    overrides = [
        f"model.name_or_path={model}",
        f"train_iters={steps}",
        f"eval_interval={every}",
        "loss_log_interval=1",
        f"logger.output_dir={out}",
        f"checkpoint.0.output_dir={out}/checkpoints",
        "checkpoint.0.save_end_of_training=false",
        "completions_log_interval=1000",
    ]
    if dynamic:
        overrides.append("dynamic_sampling=true")
    metrics = out / "train-log-metrics.jsonl"
    metrics.unlink(missing_ok=True)
    started = time.perf_counter()
    posttrain("train", "examples/grpo-reverse.yaml", *overrides)
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps_done = [r for r in records if "reward" in r]
    generated = [32 * 4 + r.get("dynamic_sampling/extra_completions", 0.0) for r in steps_done]
    return {
        "seconds": seconds,
        "heldout": [(r["iter"], r["eval_reward"]) for r in records if "eval_reward" in r],
        "generated": {r["iter"]: sum(generated[: i + 1]) for i, r in enumerate(steps_done)},
        "kept_share": [r.get("dynamic_sampling/kept_share") for r in steps_done],
        "rounds": [r.get("dynamic_sampling/generation_rounds") for r in steps_done],
    }


def reached(run: dict[str, Any], target: float) -> tuple[int | None, float | None]:
    """The first evaluated step at or above ``target`` and the completions generated until then."""
    for step, accuracy in run["heldout"]:
        if accuracy >= target - 1e-9:
            return step, run["generated"].get(step, 0.0)
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--target", type=float, default=None, help="held-out accuracy (default: plain's best)"
    )
    parser.add_argument("--work", default=str(ROOT / "demo-out" / "bench-dynamic"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = start_model(work)
    runs = {
        "plain": grpo(work, model, "plain", args.steps, args.eval_every, False),
        "dynamic_sampling": grpo(work, model, "dynamic", args.steps, args.eval_every, True),
    }
    target = args.target if args.target is not None else max(a for _, a in runs["plain"]["heldout"])
    print(f"held-out exact match (200 numbers never trained on); target {target:.1%}")
    steps = [s for s, _ in runs["plain"]["heldout"]]
    print(f"{'step':>6} " + " ".join(f"{name:>17}" for name in runs))
    for index, step in enumerate(steps):
        print(f"{step:6d} " + " ".join(f"{run['heldout'][index][1]:17.1%}" for run in runs.values()))
    for name, run in runs.items():
        step, generated = reached(run, target)
        kept = [k for k in run["kept_share"] if k is not None]
        extra = f", first round kept {sum(kept) / len(kept):.0%} of groups" if kept else ""
        where = f"step {step}, {generated:,.0f} completions generated" if step is not None else "not reached"
        print(f"{name:>17}: target at {where}; {run['seconds']:.0f} s in all{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": target, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
