"""Online RL step speed: ``posttrain train`` (``type: grpo``) with transformers' ``generate`` and with vLLM
(``use_vllm: true``), against TRL's ``GRPOTrainer``, on the same prompts, group size, completion length, reward
and optimizer, measured in one run.

    python benchmarks/grpo_step.py --size tiny,100m [--steps 6] [--rounds 2] [--json out.json]
    .venv-vllm/bin/python benchmarks/grpo_step.py --size tiny,100m \
        --runners posttrain,posttrain-vllm,posttrain-vllm-uncorrected

The ``posttrain-vllm`` runners (with TRL's importance-sampling correction, its default, and without) need
vLLM (on a CPU its CPU build: ``make vllm-env`` makes ``.venv-vllm``); without it their rows are skipped.
The engine is the colocated one, with the settings posttrain picks on a CPU.

Each runner trains in a fresh process on a random LLaMA written locally (``tiny``: hidden 64, 2 layers, 2 heads
of 32, vocabulary 1,024; ``100m``: hidden 640, 12 layers, vocabulary 32,768, 108M parameters), float32 on this CPU:
prompts ``reverse <digits>`` in the chat template, 8 completions per prompt, 4 prompts per step (32
completions, micro-batch 16 x accumulation 2), completions of up to ``--completion`` tokens at temperature 1,
the share of digit characters as the reward, AdamW at a constant lr 1e-5, no KL (beta 0), loss ``dapo``, one
update per generated batch. Steps per second are taken from the step-end times after one warm-up step; the
generation share is the time inside generation over the timed steps (both runners' ``generate`` calls are
timed the same way: posttrain reports ``time_generation``, TRL's model's ``generate`` is wrapped).

TRL is not a dependency: the script installs ``trl`` with pip when it is missing (and the index is reachable);
without it the TRL rows are skipped. A runner that fails is printed with its error and the script exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # online_runs beside this script
SIZES = {
    "tiny": {
        "hidden_size": 64,
        "layers": 2,
        "heads": 2,
        "vocab_size": 1024,
    },  # head size 32, as vLLM's CPU kernels take
    "100m": {
        "hidden_size": 640,
        "layers": 12,
        "heads": 10,
        "vocab_size": 32768,
    },  # head size 64: vLLM's CPU kernels take it
}
GROUP, PROMPTS_PER_STEP, MICRO, ACCUMULATION, LR = 8, 4, 16, 2, 1e-5
#: posttrain's runners: transformers' generate; vLLM with TRL's importance-sampling correction (its default: one
#: more forward of the trainer over the completions); vLLM without it
POSTTRAIN_RUNNERS = ("posttrain", "posttrain-vllm", "posttrain-vllm-uncorrected")


def digit_share(completions: list[Any], **kwargs: Any) -> list[float]:
    """The reward, for both runners (TRL's reward-function signature)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


REWARD_FILE = """
def digit_share(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]
"""


def write_inputs(work: Path, size: str, steps: int) -> tuple[Path, Path, Path]:
    from posttrain.tiny_model import write_tiny_model

    shape = SIZES[size]
    model = work / f"model-{size}"
    if not (model / "config.json").is_file():
        write_tiny_model(
            model,
            seed=0,
            hidden_size=shape["hidden_size"],
            layers=shape["layers"],
            heads=shape["heads"],
            vocab_size=shape["vocab_size"],
        )
    prompts = work / "prompts.jsonl"
    import random

    rng = random.Random(0)
    with prompts.open("w") as out:
        for _ in range(PROMPTS_PER_STEP * (steps + 2)):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            out.write(json.dumps({"prompt": [{"role": "user", "content": f"reverse {digits}"}]}) + "\n")
    reward = work / "reward.py"
    reward.write_text(REWARD_FILE)
    return model, prompts, reward


def run_posttrain(
    work: Path, model: Path, prompts: Path, reward: Path, steps: int, completion: int, runner: str
) -> dict:
    import yaml

    out = work / f"{runner}-run"
    shutil.rmtree(out, ignore_errors=True)  # its metrics file is appended to: a fresh one each round
    config = {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "float32", "disable_activation_checkpoint": True},
        "data": {"sources": [str(prompts)], "max_length": 64, "dl_num_workers": 0},
        "rewards": [f"{reward}:digit_share"],
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
        "loss_log_interval": 0,
        "logger": {"output_dir": str(out)},
    }
    if runner != "posttrain":
        config.update(use_vllm=True, vllm_importance_sampling_correction=runner == "posttrain-vllm")
    path = work / "posttrain.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "train", str(path)], capture_output=True, text=True, cwd=work
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    records = [json.loads(x) for x in (out / "train-log-metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward" in r]
    ends = [r["time"] for r in records]
    generation = [r["time_generation"] for r in records]
    generated = [r["completions/mean_length"] * GROUP * PROMPTS_PER_STEP for r in records]
    return _figures(ends, generation, [r["reward"] for r in records], generated)


def run_trl(work: Path, model_dir: Path, prompts: Path, steps: int, completion: int) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = load_dataset("json", data_files=str(prompts), split="train")
    generation: list[float] = []
    real_generate = model.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real_generate(*args, **kwargs)
        finally:
            generation.append(time.perf_counter() - started)

    model.generate = timed_generate
    ends: list[float] = []
    rewards: list[float] = []
    generated: list[float] = []
    per_step: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.time())
            per_step.append(sum(generation) - sum(per_step))

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                generated.append(float(logs["completions/mean_length"]) * GROUP * PROMPTS_PER_STEP)

    args = GRPOConfig(
        output_dir=str(work / "trl-run"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUMULATION,
        num_generations=GROUP,
        max_completion_length=completion,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[digit_share],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    return _figures(ends, per_step, rewards, generated)


def _figures(
    ends: list[float], generation: list[float], rewards: list[float], generated: list[float]
) -> dict[str, Any]:
    """Steps per second from the step ends after the first (warm-up) step; the generation share over them and
    the completion tokens generated per second of generation."""
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    timed = sum(gaps)
    generating = sum(generation[1:])
    return {
        "steps": len(ends),
        "steps_per_second": len(gaps) / timed if timed else None,
        "seconds_per_step": statistics.median(gaps) if gaps else None,
        "generation_share": generating / timed if timed else None,
        "generation_tokens_per_second": sum(generated[1:]) / generating if generating else None,
        "first_reward": rewards[0] if rewards else None,
        "last_reward": rewards[-1] if rewards else None,
    }


def child(args: argparse.Namespace) -> None:
    work = Path(args.work)
    model, prompts, reward = write_inputs(work, args.size, args.steps)
    if args.child in POSTTRAIN_RUNNERS:
        result = run_posttrain(work, model, prompts, reward, args.steps, args.completion, args.child)
    else:
        result = run_trl(work, model, prompts, args.steps, args.completion)
    print(json.dumps(result))


def main() -> None:
    from online_runs import arguments, ensure_trl, finish, run_rounds

    args = arguments(__doc__, "tiny,100m", "posttrain,posttrain-vllm,trl")
    if args.child:
        return child(args)
    runners = [r for r in args.runners.split(",") if r]
    if importlib.util.find_spec("vllm") is None and any("vllm" in r for r in runners):
        print(
            "vLLM is not installed here (make vllm-env; run with .venv-vllm/bin/python): its rows are skipped",
            file=sys.stderr,
        )
        runners = [r for r in runners if "vllm" not in r]
    if "trl" in runners and not ensure_trl():
        print("trl is not installed and could not be installed: its rows are skipped", file=sys.stderr)
        runners.remove("trl")
    results, failed = run_rounds(__file__, runners, args)
    _table(results)
    finish(results, failed, args.json)


def _table(results: dict[str, Any]) -> None:
    print(f"\n{results['date']}, {results['machine']}")
    print(
        "| size | runner | steps/s (median of rounds) | s/step | generation share | generated tokens/s | "
        "x transformers backend | x TRL |"
    )
    print("|---|---|---|---|---|---|---|---|")
    medians = {
        key: statistics.median(r["steps_per_second"] for r in rounds)
        for key, rounds in results["rounds"].items()
    }
    for key, rounds in results["rounds"].items():
        size, runner = key.split("/")
        share = statistics.median(r["generation_share"] for r in rounds)
        tokens = statistics.median(r["generation_tokens_per_second"] for r in rounds)
        base, trl = medians.get(f"{size}/posttrain"), medians.get(f"{size}/trl")
        versus = f"{medians[key] / base:.2f}" if base else "-"
        ratio = f"{medians[key] / trl:.2f}" if trl else "-"
        print(
            f"| {size} | {runner} | {medians[key]:.3f} | {1 / medians[key]:.2f} | {share:.0%} | {tokens:,.0f} | "
            f"{versus} | {ratio} |"
        )


if __name__ == "__main__":
    main()
