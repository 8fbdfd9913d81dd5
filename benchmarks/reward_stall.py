"""What a reward that hangs costs a GRPO step: a real run on the tiny model, 8 prompts a step with 4
completions each, a reward that sleeps far past ``reward_timeout`` on every completion of one prompt in one
step (``reward_errors: unscorable``, ``reward_num_workers`` workers). The baseline is the same run's other
steps: the script prints the hanging step's time, their median, and the difference against the timeout.

    python benchmarks/reward_stall.py [--timeout 3] [--workers 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from posttrain.testing.env import child_env

#: at step ``step`` (0-based), hangs on every completion of the call's first prompt (remembered in a file, so
#: that the one-by-one retries, in other worker processes, hang on the same prompt)
REWARD = """
import os, time

def digits(completions, answer, **kwargs):
    return [sum(ch.isdigit() for ch in (c if isinstance(c, str) else c[0]["content"])) / 10 for c in completions]

def hangs_on_one_prompt(completions, answer, trainer_state=None, **kwargs):
    if trainer_state is None or trainer_state.global_step != {step}:
        return [0.0] * len(completions)
    if not os.path.exists({marked!r}):
        with open({marked!r}, "w") as out:
            out.write(answer[0])
    marked = open({marked!r}).read()
    if marked in answer:
        time.sleep(600)
    return [0.0] * len(completions)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hang-at", type=int, default=3, help="the step whose rewards hang (1-based)")
    args = parser.parse_args()
    from posttrain.tiny_model import write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="reward-stall-"))
    model = write_tiny_model(root / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    rows = [
        {"prompt": [{"role": "user", "content": f"reverse {1000 + i}"}], "answer": str(1000 + i)[::-1]}
        for i in range(8 * args.steps)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARD.format(step=args.hang_at - 1, marked=str(root / "marked")))
    config = {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "float32", "disable_activation_checkpoint": True},
        "data": {
            "sources": [str(root / "prompts.jsonl")],
            "max_length": 64,
            "dl_num_workers": 0,
        },
        "rewards": [f"{root / 'rewards.py'}:digits", f"{root / 'rewards.py'}:hangs_on_one_prompt"],
        "num_generations": 4,
        "max_completion_length": 16,
        "micro_batch_size": 32,
        "train_iters": args.steps,
        "reward_timeout": args.timeout,
        "reward_num_workers": args.workers,
        "reward_errors": "unscorable",
        "logger": {"output_dir": str(root / "run")},
        "loss_log_interval": 1,
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "train", str(path)],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    records = [json.loads(x) for x in (root / "run" / "train-log-metrics.jsonl").read_text().splitlines()]
    ends = {r["iter"]: r["time"] for r in records if "step_time" in r}
    wall = {step: ends[step] - ends[step - 1] for step in ends if step - 1 in ends}  # generation included
    hanging = wall[args.hang_at]
    baseline = statistics.median(seconds for step, seconds in wall.items() if step != args.hang_at)
    record = next(r for r in records if r["iter"] == args.hang_at and "step_time" in r)
    timeouts = record.get("rewards/hangs_on_one_prompt/timeouts")
    print(
        f"{len(ends)} steps, 8 prompts x 4 completions, reward_timeout {args.timeout:g} s, {args.workers} workers"
    )
    print(f"the other steps, wall clock from one step's end to the next's (median): {baseline:.2f} s")
    print(
        f"the step whose reward hangs on one prompt: {hanging:.2f} s ({timeouts:g} completions timed out; "
        f"time_scoring {record['time_scoring']:.2f} s)"
    )
    print(f"hang cost / reward_timeout: {(hanging - baseline) / args.timeout:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
