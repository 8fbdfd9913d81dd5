"""On-policy distillation on the demo's task: the SFT demo's model (hidden 128, 4 layers) is the teacher; a
smaller student (hidden 64, 2 layers, the same tokenizer) is trained for the same number of steps three ways:
by SFT on the demo's chats, by on-policy distillation from the teacher on the same numbers as prompts, and by
distillation with GKD's mixing (half the batches on the teacher's samples); each is then asked to reverse 200
held-out numbers (greedy answers, exact match).

Run with ``.venv/bin/python examples/distill_demo.py`` (it runs the SFT demo first when its export is missing).
Everything is local; a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from posttrain.testing.heldout import check_disjoint  # noqa: E402

OUT = ROOT / "demo-out"
STEPS = 160
TEACHER = OUT / "run" / "checkpoints" / "final"
STUDENT = OUT / "tiny-student"


def posttrain(*args: str) -> None:
    command = [sys.executable, "-m", "posttrain", *args]
    print("$ posttrain " + " ".join(args), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def accuracy(model: Path, name: str) -> float:
    """Greedy answers to the held-out prompts, scored by exact match: grpo's evaluation of the model,
    without training (``skip_train``)."""
    out = OUT / f"distill-demo-eval-{name}"
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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.time()
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
    for previous in (
        "student-sft",
        "student-distill",
        "student-gkd",
    ):  # fresh runs: the metrics files are appended to
        shutil.rmtree(OUT / previous, ignore_errors=True)
    posttrain(
        "train",
        "examples/sft-reverse.yaml",
        f"model.name_or_path={STUDENT}",
        f"train_iters={STEPS}",
        "logger.output_dir=demo-out/student-sft",
        "checkpoint.0.output_dir=demo-out/student-sft/checkpoints",
    )
    posttrain("train", "examples/distill-reverse.yaml", f"train_iters={STEPS}")
    posttrain(  # GKD's mixing: half the batches on the teacher's own samples (sequence-level KD)
        "train",
        "examples/distill-reverse.yaml",
        f"train_iters={STEPS}",
        "lmbda=0.5",
        "seq_kd=true",
        "logger.output_dir=demo-out/student-gkd",
        "checkpoint.0.output_dir=demo-out/student-gkd/checkpoints",
    )
    results = {
        "teacher (SFT demo, hidden 128, 4 layers)": accuracy(TEACHER, "teacher"),
        f"student by SFT, {STEPS} steps": accuracy(OUT / "student-sft" / "checkpoints" / "final", "sft"),
        f"student by distillation, {STEPS} steps": accuracy(
            OUT / "student-distill" / "checkpoints" / "final", "distill"
        ),
        f"student by distillation with GKD's mixing (lmbda 0.5, seq_kd), {STEPS} steps": accuracy(
            OUT / "student-gkd" / "checkpoints" / "final", "gkd"
        ),
    }
    print("\nheld-out exact-match accuracy (greedy answers to 200 numbers never trained on):")
    for name, value in results.items():
        print(f"  {name}: {value:.1%}")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
