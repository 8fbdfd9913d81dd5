"""The demo: build a tiny model, measure held-out accuracy, fine-tune it with posttrain, measure again.

Run with ``make demo`` (or ``python examples/demo.py [--short]`` inside the project's virtual environment); it
says how long it takes before it starts. Everything is local: the model and tokenizer are built on this
machine, the data ships in examples/data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from posttrain.testing import demos  # noqa: E402
from posttrain.testing.demos import Expected, arguments, say_expected  # noqa: E402
from posttrain.testing.heldout import check_disjoint  # noqa: E402

OUT = ROOT / "demo-out"
CONFIG = ROOT / "examples" / "sft-reverse.yaml"
EVAL_FILE = ROOT / "examples" / "data" / "reverse-eval.jsonl"
# the model build and the evaluations are most of it; a fresh clone's first run takes twice as long
EXPECTED = Expected("about 30 s (1 min on a fresh clone)", "about 25 s", "2026-12-02")
SHORT = (  # --short: 120 of the config's 160 steps (its whole schedule, shorter), in a folder of its own
    "train_iters=120",
    "logger.output_dir=demo-out/run-short",
    "checkpoint.0.output_dir=demo-out/run-short/checkpoints",
)


def posttrain(*args: str) -> None:
    command = [sys.executable, "-m", "posttrain", *args]
    print("$ posttrain " + " ".join(args), flush=True)
    demos.run(command, check=True, cwd=ROOT)


def accuracy(model_dir: Path, rows: list[dict], show: int = 0) -> float:
    """Exact-match accuracy of greedy answers on the held-out rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [
        tokenizer.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    answers = [r["messages"][1]["content"] for r in rows]
    correct, shown = 0, 0
    for start in range(0, len(rows), 50):
        batch = tokenizer(
            prompts[start : start + 50], return_tensors="pt", padding=True, add_special_tokens=False
        )
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        for i, ids in enumerate(out[:, batch["input_ids"].shape[1] :]):
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            expected = answers[start + i]
            correct += text == expected
            if shown < show:
                question = rows[start + i]["messages"][0]["content"]
                print(f"    {question!r:>20} -> {text!r:<10} (expected {expected!r})")
                shown += 1
    return correct / len(rows)


def main() -> None:
    args = arguments(
        argparse.ArgumentParser(description=__doc__.split("\n")[0]), resumable=False
    ).parse_args()
    say_expected(EXPECTED, args.short, resumable=False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.time()
    rows = [json.loads(line) for line in EVAL_FILE.read_text().splitlines() if line.strip()]
    print(check_disjoint(EVAL_FILE, [EVAL_FILE.with_name("reverse-train.jsonl")]), flush=True)
    model_dir = OUT / "tiny-model"
    posttrain(
        "tiny-model", str(model_dir.relative_to(ROOT)), "--hidden-size", "128", "--layers", "4", "--seed", "0"
    )
    print("\nheld-out accuracy before training (200 numbers never seen in training):")
    before = accuracy(model_dir, rows, show=3)
    print(f"  accuracy: {before:.1%}\n")
    posttrain("train", str(CONFIG.relative_to(ROOT)), *(SHORT if args.short else ()))
    run = OUT / ("run-short" if args.short else "run")
    trained = run / "checkpoints" / "final"
    print("\nheld-out accuracy after training:")
    after = accuracy(trained, rows, show=6)
    print(f"  accuracy: {after:.1%}")
    print(f"\nbefore {before:.1%} -> after {after:.1%} in {time.time() - started:.0f} s")
    print(f"metrics: {run / 'train-log-metrics.jsonl'}; model: {trained}")
    if after <= before or (after < 0.5 and not args.short):
        raise SystemExit("the demo model did not learn the task; see the metrics file")


if __name__ == "__main__":
    main()
