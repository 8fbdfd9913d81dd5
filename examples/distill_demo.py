"""On-policy distillation on the demo's task: the SFT demo's model (hidden 128, 4 layers) is the teacher; a
smaller student (hidden 64, 2 layers, the same tokenizer) is trained for the same number of steps three ways:
by SFT on the demo's chats, by on-policy distillation from the teacher on the same numbers as prompts, and by
distillation with GKD's mixing (half the batches on the teacher's samples); each is then asked to reverse 200
held-out numbers (greedy answers, exact match).

Run with ``.venv/bin/python examples/distill_demo.py [--short] [--fresh]`` (it runs the SFT demo first when its
export is missing). Everything is local; it says how long it takes before it starts. Its runs are kept under
``demo-out/distill-demo`` (``--short``: ``distill-demo-short``); stopped, it resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
STEPS = 160
EXPECTED = Expected("about 2 min", "about 1 min", "2026-12-02")  # --short: SFT against distillation only
TEACHER = OUT / "run" / "checkpoints" / "final"
STUDENT = OUT / "tiny-student"


def posttrain(*args: str) -> None:
    command = [sys.executable, "-m", "posttrain", *args]
    print("$ posttrain " + " ".join(args), flush=True)
    demos.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def accuracy(model: Path, out: Path) -> float:
    """Greedy answers to the held-out prompts, scored by exact match: grpo's evaluation of the model,
    without training (``skip_train``)."""
    shutil.rmtree(out, ignore_errors=True)
    posttrain(
        "train",
        "examples/grpo-reverse.yaml",
        f"model.name_or_path={model}",
        "skip_train=true",
        "eval_on_start=false",
        f"logger.output_dir={out}",
        f"checkpoint.0.output_dir={out}/checkpoints",
    )
    records = [json.loads(line) for line in (out / "train-log-metrics.jsonl").read_text().splitlines()]
    return float(records[-1]["eval_reward"])


def main() -> None:
    args = arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args()
    say_expected(EXPECTED, args.short)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.time()
    steps = STEPS
    data = ROOT / "examples" / "data"  # the SFT's chats and distill's prompts, against the held-out prompts
    print(
        check_disjoint(
            data / "reverse-prompts-eval.jsonl",
            [data / "reverse-train.jsonl", data / "reverse-prompts.jsonl"],
        )
    )
    if not (TEACHER / "config.json").is_file():
        if not (OUT / "tiny-model" / "config.json").is_file():
            posttrain(
                "tiny-model", "demo-out/tiny-model", "--hidden-size", "128", "--layers", "4", "--seed", "0"
            )
        posttrain("train", "examples/sft-reverse.yaml")  # the SFT demo: the teacher
    if not (STUDENT / "config.json").is_file():
        posttrain(
            "tiny-model", str(STUDENT), "--hidden-size", "64", "--layers", "2", "--heads", "2", "--seed", "0"
        )
    stages = Stages(OUT / ("distill-demo-short" if args.short else "distill-demo"), args.fresh)
    root = stages.out.relative_to(ROOT)

    def where(name: str) -> list[str]:
        out = f"{root}/{name}"
        return [
            f"logger.output_dir={out}",
            f"checkpoint.0.output_dir={out}/checkpoints",
            resume_override(out, 20),
        ]

    sft = ["examples/sft-reverse.yaml", f"model.name_or_path={STUDENT}", f"train_iters={steps}"]
    stages.run("student-sft", lambda: posttrain("train", *sft, *where("student-sft")))
    distill = ["examples/distill-reverse.yaml", f"train_iters={steps}"]
    stages.run("student-distill", lambda: posttrain("train", *distill, *where("student-distill")))
    # GKD's mixing: half the batches on the teacher's own samples (sequence-level KD)
    gkd = [*distill, "lmbda=0.5", "seq_kd=true"]
    if not args.short:  # the short version leaves GKD's mixing out
        stages.run("student-gkd", lambda: posttrain("train", *gkd, *where("student-gkd")))
    models = {
        "teacher (SFT demo, hidden 128, 4 layers)": TEACHER,
        f"student by SFT, {steps} steps": stages.out / "student-sft" / "checkpoints" / "final",
        f"student by distillation, {steps} steps": stages.out / "student-distill" / "checkpoints" / "final",
    }
    if not args.short:
        gkd_model = stages.out / "student-gkd" / "checkpoints" / "final"
        models[f"student by distillation with GKD's mixing (lmbda 0.5, seq_kd), {steps} steps"] = gkd_model
    results = {
        name: accuracy(model, stages.out / f"eval-{i}") for i, (name, model) in enumerate(models.items())
    }
    print("\nheld-out exact-match accuracy (greedy answers to 200 numbers never trained on):")
    for name, value in results.items():
        print(f"  {name}: {value:.1%}")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
