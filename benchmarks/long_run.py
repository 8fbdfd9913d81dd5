"""Long runs stay flat: a tiny model trained for 100,000 cheap optimizer steps, one process, through
``posttrain train``; the resident memory of the process (``memory_rss_gib`` in the metrics file) is printed at
intervals, with the growth from step 1,000 to the last step.

    python benchmarks/long_run.py [--steps 100000] [--out bench-out/long-run]
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path("bench-out/long-run"))
    args = parser.parse_args()
    out = args.out.resolve()
    from posttrain.testing.data import chat_rows, write_jsonl
    from posttrain.tiny_model import write_tiny_model

    model = out / "model"
    if not (model / "config.json").is_file():
        write_tiny_model(model, seed=0, hidden_size=16, layers=1, vocab_size=512, heads=2)
    data = write_jsonl(out / "chat.jsonl", chat_rows(64))
    run = out / "run"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    config = {
        "type": "sft",
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "data": {"sources": [str(data)], "max_length": 32, "dl_num_workers": 0},
        "micro_batch_size": 1,
        "train_iters": args.steps,
        "epochs": args.steps,  # train_iters ends the run
        "optimizer": {"lr": 1e-4},
        "scheduler": {"name": "constant", "warmup_ratio": 0},
        "logger": {"output_dir": str(run), "progress_bar": False},
        "loss_log_interval": 0,
    }
    path = out / "long-run.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "posttrain", "train", str(path)], check=True, env=os.environ.copy())
    seconds = time.perf_counter() - started
    rss = {}
    with open(run / "train-log-metrics.jsonl") as handle:
        for line in handle:
            record = json.loads(line)
            if "memory_rss_gib" in record:
                rss[record["iter"]] = record["memory_rss_gib"]
    marks = [m for m in (1, 1000, 10_000, 25_000, 50_000, 75_000, args.steps) if m in rss]
    print(
        f"\n== {args.steps} optimizer steps in {seconds:.0f} s ({seconds / args.steps * 1e3:.2f} ms/step) =="
    )
    for mark in marks:
        print(f"step {mark:>7}: RSS {rss[mark] * 1024:8.1f} MiB")
    base = rss.get(1000, rss[marks[0]])
    print(f"growth from step 1,000 to step {args.steps}: {(rss[args.steps] - base) * 1024:+.1f} MiB")


if __name__ == "__main__":
    main()
