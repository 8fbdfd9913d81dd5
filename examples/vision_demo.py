"""The vision demo: a tiny vision-language model learns to read the colour of a square from the image.

Builds a tiny Idefics3 (SmolVLM's architecture) with its processor, draws coloured squares with Pillow
(train and held-out rows from different seeds), measures held-out accuracy, fine-tunes with
``posttrain train examples/sft-vision.yaml``, and measures again, with the control: the same held-out
questions asked about another row's image, which a model that reads the image answers at chance (1/3).
Then GRPO (``examples/grpo-vision.yaml``, a reward for naming the colour) raises the share of answers
sampled at temperature 1 that are right, again with the images-swapped control, and ``posttrain eval`` runs
lm-evaluation-harness's multimodal model on a local task of 30 more squares.
Everything is local. Run inside the project's virtual environment: ``.venv/bin/python examples/vision_demo.py
[--short] [--arch FAMILY]`` (``make demo-vision``); it says how long it takes before it starts. The Qwen-VL
family's processors need torchvision: ``make vision-env``, then ``.venv-vision/bin/python
examples/vision_demo.py --arch qwen2_vl`` (or ``qwen2_5_vl``, ``qwen3_vl``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from posttrain.testing import demos  # noqa: E402
from posttrain.testing.data import write_jsonl  # noqa: E402
from posttrain.testing.demos import Expected, arguments, say_expected  # noqa: E402
from posttrain.testing.vision import (  # noqa: E402
    colour_accuracy,
    colour_prompts,
    colour_rows,
    colour_sampled_accuracy,
    write_colour_task,
)
from posttrain.vision.tiny import NEEDS_TORCHVISION, VISION_ARCHITECTURES, torchvision_missing  # noqa: E402

OUT = ROOT / "demo-out" / "vision"
CONFIG = ROOT / "examples" / "sft-vision.yaml"
GRPO = ROOT / "examples" / "grpo-vision.yaml"
EXPECTED = Expected("about 1.5 min", "about 40 s", "2026-12-02")  # --short: the SFT part only


def posttrain(*args: str) -> None:
    print("$ posttrain " + " ".join(args), flush=True)
    demos.run([sys.executable, "-m", "posttrain", *args], check=True, cwd=ROOT)


def main() -> None:
    parser = arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]), resumable=False)
    parser.add_argument(
        "--arch", choices=VISION_ARCHITECTURES, default="idefics3", help="the tiny model's family"
    )
    args = parser.parse_args()
    if args.arch in NEEDS_TORCHVISION and (missing := torchvision_missing()) is not None:
        print(
            f"--arch {args.arch}: its processor needs torchvision, which does not import here ({missing}); "
            f"run `make vision-env`, then `.venv-vision/bin/python examples/vision_demo.py --arch {args.arch}`",
            file=sys.stderr,
        )
        raise SystemExit(2)
    say_expected(EXPECTED, args.short, resumable=False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.time()
    write_jsonl(OUT / "train.jsonl", colour_rows(OUT, 192, seed=1))
    write_jsonl(OUT / "prompts.jsonl", colour_prompts(OUT, 192, seed=3))  # GRPO's prompts
    held_out = colour_rows(OUT, 60, seed=2)  # other squares, other places
    model_dir = OUT / f"tiny-{args.arch}"
    posttrain("tiny-model", str(model_dir.relative_to(ROOT)), "--arch", args.arch, "--seed", "0")
    before = colour_accuracy(model_dir, held_out, OUT)
    print(f"\nheld-out accuracy before training (60 squares never seen): {before:.1%}\n")
    posttrain("train", str(CONFIG.relative_to(ROOT)), f"model.name_or_path={model_dir.relative_to(ROOT)}")
    trained = OUT / "export" / "final"
    after = colour_accuracy(trained, held_out, OUT)
    control = colour_accuracy(trained, held_out, OUT, swap=True)
    print(f"\nheld-out accuracy after training: {after:.1%}")
    print(f"control, each question asked about another row's image: {control:.1%} (chance: 33.3%)")
    if after < 0.8 or control > 0.6:
        raise SystemExit("the demo model did not learn to read the image; see demo-out/vision/run")
    if args.short:  # the SFT part only
        print(
            f"\nSFT: before {before:.1%} -> after {after:.1%}, images swapped {control:.1%}; in {time.time() - started:.0f} s"
        )
        return
    sampled = colour_sampled_accuracy(trained, held_out, OUT)
    print(f"answers sampled at temperature 1 that are right: {sampled:.1%}\n")
    posttrain("train", str(GRPO.relative_to(ROOT)))
    tuned = OUT / "grpo-export" / "final"
    rl = colour_sampled_accuracy(tuned, held_out, OUT)
    rl_control = colour_sampled_accuracy(tuned, held_out, OUT, swap=True)
    print(
        f"\nafter GRPO, answers sampled at temperature 1 that are right: {rl:.1%} (images swapped: {rl_control:.1%})"
    )
    print(
        f"\nSFT: before {before:.1%} -> after {after:.1%}, images swapped {control:.1%}; GRPO: sampled answers "
        f"{sampled:.1%} -> {rl:.1%}, images swapped {rl_control:.1%}; in {time.time() - started:.0f} s"
    )
    tasks = write_colour_task(OUT / "tasks", 30, seed=4)  # a local lm-evaluation-harness task on images
    posttrain(
        "eval",
        str(tuned.relative_to(ROOT)),
        "--tasks",
        "colour_squares",
        "--include-path",
        str(tasks.relative_to(ROOT)),
        "--apply-chat-template",
        "--batch-size",
        "10",
    )
    print(
        f"try it: posttrain chat {tuned.relative_to(ROOT)} --image {OUT.relative_to(ROOT)}/images/2-0.png "
        "--prompt 'What colour is the square?' --temperature 0"
    )
    if rl <= sampled or rl_control > 0.6:
        raise SystemExit("GRPO did not raise the share of right answers; see demo-out/vision/grpo-run")


if __name__ == "__main__":
    main()
