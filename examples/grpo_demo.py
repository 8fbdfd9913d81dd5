"""Online RL on the demo's task: SFT stopped early leaves the model partly right; GRPO with an exact-match
reward on the same kind of prompts raises its held-out accuracy.

Run with ``.venv/bin/python examples/grpo_demo.py [--short] [--fresh]`` (it builds ``demo-out/tiny-model`` when
missing). Everything is local; it says how long it takes before it starts. Its runs are kept under
``demo-out/grpo-demo`` (``--short``: ``grpo-demo-short``); stopped, it resumes where it stopped.

``.venv-vllm/bin/python examples/grpo_demo.py --max-staleness 0,1`` runs GRPO once per lag instead, generating
on a ``posttrain vllm-serve`` server (on half the cores, the trainer on the others): ``max_staleness: 1``
trains batch k on completions from the weights after k - 1 updates, generated while the trainer trains.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from posttrain.testing import demos  # noqa: E402
from posttrain.testing.demos import Expected, Stages, arguments, resume_override, say_expected  # noqa: E402
from posttrain.testing.heldout import check_disjoint  # noqa: E402

OUT = ROOT / "demo-out"
GRPO_STEPS, SHORT_STEPS = 100, 40  # the config's train_iters, and the short version's
EXPECTED = Expected("about 1.5 min", "about 45 s", "2026-12-02")
LAGGED = Expected("about 6 min for 0,1", "about 3 min for 0,1", "2026-12-02")


def posttrain(*args: str, cores: list[int] | None = None) -> None:
    command = [sys.executable, "-m", "posttrain", *args]
    if cores:
        command = ["taskset", "-c", ",".join(map(str, cores)), *command]
    print("$ posttrain " + " ".join(args), flush=True)
    demos.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def held_out(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["iter"], r["eval_reward"]) for r in records if "eval_reward" in r]


def grpo_overrides(out: str, steps: int, sft: str) -> list[str]:
    """The demo's GRPO run under ``out``: from the early-stopped SFT model, resumable, ``steps`` long."""
    every = 25 if steps == GRPO_STEPS else 20
    return [
        f"model.name_or_path={sft}/checkpoints/global_step_50",
        f"train_iters={steps}",
        f"eval_interval={every}",
        f"logger.output_dir={out}",
        f"checkpoint.0.output_dir={out}/checkpoints",
        resume_override(out, 10),
    ]


def lagged_runs(lags: list[int], stages: Stages, steps: int, sft: str) -> dict[int, list[tuple[int, float]]]:
    """GRPO once per ``max_staleness``, generating on one ``posttrain vllm-serve`` server (each run pushes its
    own weights first); the held-out accuracies of each. A lag whose run is done is kept."""
    from posttrain.dist import free_port
    from posttrain.generation.vllm_engine import usable_cores
    from posttrain.testing.served import vllm_server

    os.chdir(ROOT)  # the config's paths are the repository's
    cores = usable_cores()
    serving, training = cores[: max(1, len(cores) // 2)], cores[len(cores) // 2 :] or cores
    port = free_port()
    server = ("use_vllm=true", "vllm_mode=server", "vllm_server_host=127.0.0.1", f"vllm_server_port={port}")
    config = ROOT / "examples" / "grpo-reverse.yaml"
    root = stages.out.relative_to(ROOT)
    print(
        f"$ posttrain vllm-serve {config.relative_to(ROOT)} {' '.join(server)} --cores {serving[0]}-{serving[-1]}"
    )
    found = {}
    model = (
        f"model.name_or_path={sft}/checkpoints/global_step_50"  # the server starts from what GRPO starts from
    )
    with vllm_server(config, stages.out / "grpo-server.log", port, serving, (*server, model)):
        for lag in lags:
            out = f"{root}/grpo-lag{lag}"

            def run(lag: int = lag, out: str = out) -> None:
                print(f"taskset -c {','.join(map(str, training))} ", end="")
                overrides = [f"max_staleness={lag}", *grpo_overrides(out, steps, sft)]
                posttrain("train", str(config.relative_to(ROOT)), *server, *overrides, cores=training)

            stages.run(f"grpo-lag{lag}", run)
            metrics = ROOT / out / "train-log-metrics.jsonl"
            found[lag] = held_out([json.loads(line) for line in metrics.read_text().splitlines()])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-staleness", default=None, help="lags to compare on a vLLM server, e.g. 0,1")
    args = arguments(parser).parse_args()
    say_expected(LAGGED if args.max_staleness is not None else EXPECTED, args.short)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.time()
    data = ROOT / "examples" / "data"  # the SFT's chats and grpo's prompts, against grpo's held-out prompts
    print(
        check_disjoint(
            data / "reverse-prompts-eval.jsonl",
            [data / "reverse-train.jsonl", data / "reverse-prompts.jsonl"],
        )
    )
    stages = Stages(OUT / ("grpo-demo-short" if args.short else "grpo-demo"), args.fresh)
    root = stages.out.relative_to(ROOT)
    steps = SHORT_STEPS if args.short else GRPO_STEPS
    if not (OUT / "tiny-model" / "config.json").is_file():
        posttrain("tiny-model", "demo-out/tiny-model", "--hidden-size", "128", "--layers", "4", "--seed", "0")
    sft = f"{root}/sft-early"
    stages.run(
        "sft-early",
        lambda: posttrain(
            "train",
            "examples/sft-reverse.yaml",
            "exit_iteration=50",  # stopped early: partly right
            "eval_interval=0",
            f"logger.output_dir={sft}",
            f"checkpoint.0.output_dir={sft}/checkpoints",
        ),
    )
    if args.max_staleness is not None:
        runs = lagged_runs([int(x) for x in args.max_staleness.split(",")], stages, steps, sft)
        print("\nheld-out exact-match accuracy (greedy answers to 200 numbers never trained on):")
        for lag, accuracies in runs.items():
            shown = ", ".join(f"{accuracy:.1%} after {step}" for step, accuracy in accuracies)
            print(f"  max_staleness {lag}: {shown}")
        print(f"done in {time.time() - started:.0f} s")
        return
    out = f"{root}/grpo"
    stages.run(
        "grpo", lambda: posttrain("train", "examples/grpo-reverse.yaml", *grpo_overrides(out, steps, sft))
    )
    metrics = ROOT / out / "train-log-metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    print("\nheld-out exact-match accuracy (greedy answers to 200 numbers never trained on):")
    for step, accuracy in held_out(records):
        print(f"  after {step:3d} GRPO steps: {accuracy:.1%}")
    print(f"\ncompletions sampled during training: {ROOT / out / 'completions.jsonl'}")
    print(f"curves: posttrain plot {metrics.relative_to(ROOT)} -o grpo-curves.png")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
