"""An agent that learns to use its tool: multiplying two 2-digit numbers, which the tiny model does badly from
its own arithmetic and exactly with a calculator (``posttrain.testing.tool_task.Calculator``, TRL's
``environment_factory``: ``multiply`` is its tool, ``get_reward`` 1 when the rollout computed the product the
row asks for).

It starts from the SFT demo's model (``examples/sft-reverse.yaml``: it reverses numbers, so it already moves
digits about; run first when its export is missing). Two SFT runs, each to the end of its schedule, so that
nothing rides on where a run is stopped: the first on tool-call conversations (the call, the tool's result,
the answer; ``tokenizer.chat_template: hermes``), where the model learns to copy the operands into the call
(from about step 130 on both seeds tried, and more surely as it goes on; from the untrained model this takes 250 steps or more, and
when varies from run to run); the second, short, on conversations that mostly answer directly, so that the
model prefers its own arithmetic. Greedy, it then
never calls the tool (held-out reward near 0); sampled, it sometimes does, rightly. GRPO with the
environment's reward teaches it to use the calculator. The SFT conversations, the GRPO prompts and the 64
held-out products are distinct pairs (checked before training).

Run ``.venv/bin/python examples/agent_demo.py [--seed N] [--short] [--fresh]`` (it says how long it takes before
it starts, and runs the SFT demo first when its export is missing). Progress is printed as it goes; stopped,
it resumes where it stopped (each stage is kept once done, each run resumes from its last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from posttrain.testing import demos, tool_task  # noqa: E402
from posttrain.testing.demos import Expected, Stages, arguments, resume_engine, say_expected  # noqa: E402
from posttrain.testing.heldout import check_disjoint  # noqa: E402

SFT_ROWS, PROMPTS, HELD_OUT = 2000, 512, 64
CALL_STEPS = 400  # the first SFT: the operands are copied into the call from about step 130
DIRECT_STEPS, DIRECT_EVERY = 60, 10  # the second: 9 in 10 conversations answer directly
GRPO_STEPS, EVAL_EVERY = 30, 10
SHORT = {"calls": 200, "direct": 30, "grpo": 10}  # --short: each run's steps
EXPECTED = Expected("about 8 min", "about 3.5 min", "2026-12-02")  # plus the SFT demo when missing
TINY_MODEL = ("--hidden-size", "128", "--layers", "4", "--seed", "0")  # the demo's model (make demo's)
REVERSING = ROOT / "demo-out" / "run" / "checkpoints" / "final"  # the SFT demo's export


def posttrain(config: dict, out: Path, name: str) -> Path:
    """Run ``posttrain train`` on ``config``, printing its evaluations and every tenth step as they come."""
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    print(f"$ posttrain train {path.relative_to(ROOT)}", flush=True)
    process = demos.popen(
        [sys.executable, "-m", "posttrain", "train", str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    tail: list[str] = []
    for line in process.stdout:
        tail = [*tail, line][-30:]
        shown = line.split("] ", 2)[-1].strip()
        if "eval_" in shown or (shown.startswith("iter ") and shown.split("/")[0].endswith("0")):
            print(f"    {shown[:110]}", flush=True)
    if process.wait() != 0:
        sys.exit("".join(tail))
    return out / name


def sft(out: Path, name: str, rows: list[dict], base: str, steps: int, lr: float) -> Path:
    """An SFT run from ``base`` on ``rows`` over its whole cosine schedule; its export."""
    data = tool_task.write_rows(out / f"{name}.jsonl", rows)
    posttrain(
        {
            "type": "sft",
            "model": {"name_or_path": base, "dtype": "float32", "disable_activation_checkpoint": True},
            "tokenizer": {"chat_template": "hermes"},
            "data": {"sources": [str(data)], "max_length": 256, "dl_num_workers": 0},
            "micro_batch_size": 32,
            "train_iters": steps,
            "optimizer": {"lr": lr},
            "scheduler": {"name": "cosine", "warmup_ratio": 0.05},
            "logger": {"output_dir": str(out / name)},
            "checkpoint": [
                {
                    "type": "huggingface",
                    "output_dir": str(out / name / "export"),
                    "save_end_of_training": True,
                },
                resume_engine(out / name, 20),
            ],
        },
        out,
        name,
    )
    return out / name / "export" / "final"


def grpo(
    out: Path, model: Path, prompts: Path, held: Path, name: str, seed: int, steps: int
) -> list[tuple[int, dict]]:
    """GRPO with the calculator environment, its ``get_reward`` the reward; the held-out evaluations by step."""
    run = posttrain(
        {
            "type": "grpo",
            "seed": seed,
            "model": {"name_or_path": str(model), "dtype": "float32", "disable_activation_checkpoint": True},
            "data": {
                "sources": [str(prompts)],
                "eval_sources": [str(held)],
                "max_length": 192,
                "dl_num_workers": 0,
            },
            "environment_factory": tool_task.environment_entry(),
            "rewards": [],  # the environment's get_reward
            "num_generations": 8,
            "max_completion_length": 96,
            "temperature": 1.0,
            "loss_type": "dapo",
            "micro_batch_size": 32,
            "gradient_accumulation_steps": 4,
            "train_iters": steps,
            "eval_interval": EVAL_EVERY,
            "eval_on_start": True,
            "optimizer": {"lr": 3e-4, "weight_decay": 0.0},
            "scheduler": {"name": "constant", "warmup_ratio": 0},
            "logger": {"output_dir": str(out / name)},
            "checkpoint": [resume_engine(out / name, 5)],
        },
        out,
        name,
    )
    records = [json.loads(line) for line in (run / "train-log-metrics.jsonl").read_text().splitlines()]
    return [(r["iter"], r) for r in records if "eval_reward" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the pairs drawn and the runs' seed")
    args = arguments(parser).parse_args()
    seed = args.seed
    say_expected(EXPECTED, args.short)
    steps = SHORT if args.short else {"calls": CALL_STEPS, "direct": DIRECT_STEPS, "grpo": GRPO_STEPS}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.time()
    name = ("agent" if seed == 0 else f"agent-seed{seed}") + ("-short" if args.short else "")
    stages = Stages(ROOT / "demo-out" / name, args.fresh)
    out = stages.out
    if not (REVERSING / "config.json").is_file():  # the SFT demo's model (make demo's)
        if not (ROOT / "demo-out" / "tiny-model" / "config.json").is_file():
            demos.run(
                [sys.executable, "-m", "posttrain", "tiny-model", "demo-out/tiny-model", *TINY_MODEL],
                check=True,
                cwd=ROOT,
            )
        print(
            "$ posttrain train examples/sft-reverse.yaml  (the SFT demo: the model to start from)", flush=True
        )
        demos.run(
            [sys.executable, "-m", "posttrain", "train", "examples/sft-reverse.yaml"],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
    taught, asked, kept = tool_task.distinct_pairs([SFT_ROWS, PROMPTS, HELD_OUT], seed)
    prompts = tool_task.write_rows(out / "prompts.jsonl", [tool_task.prompt_row(a, b) for a, b in asked])
    held = tool_task.write_rows(out / "held-out.jsonl", [tool_task.prompt_row(a, b) for a, b in kept])
    calls = [tool_task.tool_call_row(a, b) for a, b in taught]
    mixed = [
        row if i % DIRECT_EVERY == 0 else tool_task.direct_row(*pair, offered=True)
        for i, (row, pair) in enumerate(zip(calls, taught, strict=True))
    ]
    tool_task.write_rows(out / "sft-calls.jsonl", calls)
    tool_task.write_rows(out / "sft-direct.jsonl", mixed)
    print(check_disjoint(held, [out / "sft-calls.jsonl", out / "sft-direct.jsonl", prompts]), flush=True)
    print(f"1/3 SFT on {SFT_ROWS} tool-call conversations, {steps['calls']} steps", flush=True)
    stages.run("sft-calls", lambda: sft(out, "sft-calls", calls, str(REVERSING), steps["calls"], 3e-3))
    calling = out / "sft-calls" / "export" / "final"
    print(
        f"2/3 SFT on answering directly ({DIRECT_EVERY - 1} in {DIRECT_EVERY}), {steps['direct']} steps",
        flush=True,
    )
    stages.run("sft-direct", lambda: sft(out, "sft-direct", mixed, str(calling), steps["direct"], 1e-3))
    model = out / "sft-direct" / "export" / "final"
    print(f"3/3 GRPO with the calculator: {steps['grpo']} steps of 16 prompts x 8 completions", flush=True)
    curve: list[tuple[int, dict]] = []
    stages.run("grpo", lambda: curve.extend(grpo(out, model, prompts, held, "grpo", seed, steps["grpo"])))
    if not curve:  # done earlier: its records
        records = (out / "grpo" / "train-log-metrics.jsonl").read_text().splitlines()
        curve = [(r["iter"], r) for r in map(json.loads, records) if "eval_reward" in r]
    print(
        f"\nheld-out: the share of the {HELD_OUT} products (never trained on) the agent computes with its calculator"
    )
    print("  " + ", ".join(f"{record['eval_reward']:.1%} at step {step}" for step, record in curve))
    print(f"completions with their tool calls: {(out / 'grpo' / 'completions.jsonl').relative_to(ROOT)}")
    print(f"done in {time.time() - started:.0f} s (seed {seed})")


if __name__ == "__main__":
    main()
