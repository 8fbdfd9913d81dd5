"""On-policy distillation step speed: ``posttrain train`` (``type: distill``) against TRL 1.16's
``DistillationTrainer`` on the same prompts, completion length, divergence, teacher and student, measured in
one run.

    python benchmarks/distill_step.py [--size tiny,small] [--steps 6] [--rounds 2] [--json out.json]

Each runner trains in a fresh process on random LLaMAs written locally with the same tokenizer (``tiny``:
student hidden 64, 2 layers, teacher hidden 128, 4 layers, vocabulary 1,024; ``small``: student hidden 256, 4
layers, teacher hidden 512, 8 layers, vocabulary 32,768), float32 on this CPU: ``reverse <digits>`` prompts in
the chat template, 32 prompts a step (micro-batch 16 x accumulation 2), one completion of up to ``--completion``
tokens each at temperature 1, beta 0.5 (JSD), AdamW at a constant lr 1e-5. Steps per second from the step-end
times after one warm-up step, the median over the rounds.

TRL is not a dependency: the script installs it with pip when missing (and the index is reachable); without it
the TRL rows are skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
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
    "tiny": (
        {"hidden_size": 64, "layers": 2, "heads": 2},
        {"hidden_size": 128, "layers": 4, "heads": 4},
        1024,
    ),
    "small": (
        {"hidden_size": 256, "layers": 4, "heads": 4},
        {"hidden_size": 512, "layers": 8, "heads": 8},
        32768,
    ),
}
MICRO, ACCUMULATION, LR, BETA = 16, 2, 1e-5, 0.5


def write_inputs(work: Path, size: str, steps: int) -> tuple[Path, Path, Path]:
    from posttrain.tiny_model import write_tiny_model

    student_shape, teacher_shape, vocab = SIZES[size]
    student, teacher = work / f"student-{size}", work / f"teacher-{size}"
    for path, shape in ((student, student_shape), (teacher, teacher_shape)):
        if not (path / "config.json").is_file():
            write_tiny_model(path, seed=0, vocab_size=vocab, **shape)
    prompts = work / "prompts.jsonl"
    rng = random.Random(0)
    with prompts.open("w") as out:
        for _ in range(MICRO * ACCUMULATION * (steps + 2)):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            out.write(json.dumps({"prompt": [{"role": "user", "content": f"reverse {digits}"}]}) + "\n")
    return student, teacher, prompts


def run_posttrain(
    work: Path, student: Path, teacher: Path, prompts: Path, steps: int, completion: int
) -> dict:
    import yaml

    out = work / "posttrain-run"
    shutil.rmtree(out, ignore_errors=True)
    config = {
        "type": "distill",
        "model": {"name_or_path": str(student), "dtype": "float32", "disable_activation_checkpoint": True},
        "teacher_model_name_or_path": str(teacher),
        "beta": BETA,
        "data": {"sources": [str(prompts)], "max_length": 64, "dl_num_workers": 0},
        "max_completion_length": completion,
        "temperature": 1.0,
        "micro_batch_size": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "train_iters": steps,
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        "scheduler": {"name": "constant", "warmup_ratio": 0},
        "log_completions": False,
        "loss_log_interval": 0,
        "logger": {"output_dir": str(out)},
    }
    path = work / "posttrain.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "train", str(path)], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    records = [json.loads(x) for x in (out / "train-log-metrics.jsonl").read_text().splitlines()]
    return _figures([r["time"] for r in records if "loss" in r])


def run_trl(work: Path, student: Path, teacher: Path, prompts: Path, steps: int, completion: int) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    tokenizer = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    dataset = load_dataset("json", data_files=str(prompts), split="train")
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.time())

    args = DistillationConfig(
        output_dir=str(work / "trl-run"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUMULATION,
        max_completion_length=completion,
        temperature=1.0,
        beta=BETA,
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
    trainer = DistillationTrainer(
        model=model,
        teacher_model=teacher_model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    return _figures(ends)


def _figures(ends: list[float]) -> dict[str, Any]:
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    timed = sum(gaps)
    return {
        "steps": len(ends),
        "steps_per_second": len(gaps) / timed if timed else None,
        "seconds_per_step": statistics.median(gaps) if gaps else None,
    }


def child(args: argparse.Namespace) -> None:
    work = Path(args.work)
    student, teacher, prompts = write_inputs(work, args.size, args.steps)
    run = run_posttrain if args.child == "posttrain" else run_trl
    print(json.dumps(run(work, student, teacher, prompts, args.steps, args.completion)))


def main() -> None:
    from online_runs import arguments, ensure_trl, finish, run_rounds

    args = arguments(__doc__, "tiny,small", "posttrain,trl")
    if args.child:
        return child(args)
    runners = [r for r in args.runners.split(",") if r]
    if "trl" in runners and not ensure_trl():
        print("trl is not installed and could not be installed: its rows are skipped", file=sys.stderr)
        runners.remove("trl")
    results, failed = run_rounds(__file__, runners, args)
    print(f"\n{results['date']}, {results['machine']}")
    print("| size | runner | steps/s (median of rounds) | s/step | x TRL |")
    print("|---|---|---|---|---|")
    medians = {k: statistics.median(r["steps_per_second"] for r in v) for k, v in results["rounds"].items()}
    for key in results["rounds"]:
        size, runner = key.split("/")
        trl = medians.get(f"{size}/trl")
        ratio = f"{medians[key] / trl:.2f}" if trl else "-"
        print(f"| {size} | {runner} | {medians[key]:.3f} | {1 / medians[key]:.2f} | {ratio} |")
    finish(results, failed, args.json)


if __name__ == "__main__":
    main()
