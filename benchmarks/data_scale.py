"""Data at scale: preprocessing speed and memory against the baseline TRL and ArcticTraining use, and the
memory of training ranks on large against small processed data.

    python benchmarks/data_scale.py [--rows 200000] [--out bench-out/data-scale]

It generates chat rows of realistic lengths (1-3 turns, 10-300 words per message), then measures, in one run:
1. preprocessing: posttrain's data build (``data.num_proc: 2``) against a ``datasets.map`` (``num_proc=2``)
   that calls ``tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)`` per row, as TRL and
   ArcticTraining do: rows/s, tokens/s and the ratio; the peak memory of each process tree (RSS summed over the
   processes, and PSS, which counts shared pages once);
2. opening the cache on a second run with the same inputs (a fresh process);
3. the peak RSS of each rank of ``posttrain train --nproc 2`` (3 steps) on the processed rows, against the
   same run on the first 2,000 rows;
4. best-fit packing of 1,000,000 sample lengths.
Each phase runs in its own process; RSS is sampled every 0.2 s with psutil (PSS every 2 s: reading it costs
CPU time that the measured processes would miss on a small machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
MAX_LENGTH = 2048


def write_rows(path: Path, count: int, seed: int = 0) -> None:
    """Chat rows: 1-3 turns, each message 10-300 words drawn from English-like words and pseudo-words."""
    from posttrain.tiny_model import _WORDS

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    pseudo = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(5000)]
    vocabulary = np.array(list(_WORDS) + pseudo + [str(i) for i in range(2000)])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(count):
            messages = []
            for _ in range(int(rng.integers(1, 4))):
                for role in ("user", "assistant"):
                    words = vocabulary[rng.integers(0, len(vocabulary), size=int(rng.integers(10, 301)))]
                    messages.append({"role": role, "content": " ".join(words.tolist())})
            handle.write(json.dumps({"messages": messages}) + "\n")


def tree_memory(pid: int, pss: bool) -> tuple[float, float, dict[int, float]]:
    """(RSS summed, PSS summed or 0, RSS per process) of a process and its descendants, in GiB. PSS reads
    every mapping of every process, so it is asked for only now and then."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0, {}
    rss = shared = 0.0
    each = {}
    for process in processes:
        try:
            info = process.memory_full_info() if pss else process.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        shared += getattr(info, "pss", 0)
        each[process.pid] = info.rss / 2**30
    return rss / 2**30, shared / 2**30, each


def run_measured(command: list[str], env: dict[str, str] | None = None) -> dict:
    """Run a command; return its wall time, peak tree RSS/PSS, per-process peak RSS and its JSON result
    (the last stdout line that parses as JSON)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peaks = {"rss": 0.0, "pss": 0.0, "each": {}}

    def sample() -> None:
        ticks = 0
        while process.poll() is None:
            rss, pss, each = tree_memory(process.pid, pss=ticks % 10 == 0)
            ticks += 1
            peaks["rss"], peaks["pss"] = max(peaks["rss"], rss), max(peaks["pss"], pss)
            for pid, value in each.items():
                peaks["each"][pid] = max(peaks["each"].get(pid, 0.0), value)
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    output = process.communicate()[0]
    thread.join()
    if process.returncode:
        sys.exit(f"command failed ({process.returncode}): {' '.join(command)}\n{output[-4000:]}")
    result = {}
    for line in output.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                result = json.loads(line)
    return {"wall": time.perf_counter() - started, **peaks, "result": result, "output": output}


BASELINE = textwrap.dedent(
    """
    import json, sys, time
    import datasets
    from transformers import AutoTokenizer
    path, model, cache = sys.argv[1:4]
    MAX_LENGTH = int(sys.argv[4])
    tokenizer = AutoTokenizer.from_pretrained(model)
    started = time.perf_counter()
    rows = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache)
    def format_row(row):
        out = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}
    done = rows.map(format_row, num_proc=2, remove_columns=rows.column_names)
    seconds = time.perf_counter() - started
    lengths = [len(x) for x in done["input_ids"]]
    kept = [n for n in lengths if n <= MAX_LENGTH]
    print(json.dumps({"seconds": seconds, "rows": len(rows), "tokens": sum(kept), "kept": len(kept)}))
    """
)

POSTTRAIN = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from posttrain.config import load_config
    from posttrain.context import RunContext
    from posttrain.dist import DistInfo
    from posttrain.registry import TOKENIZER_FACTORIES
    from posttrain.data.cache import load_datasets
    config = load_config(sys.argv[1])
    ctx = RunContext(config, DistInfo(0, 0, 1, torch.device("cpu")))
    tokenizer = TOKENIZER_FACTORIES.get(config.tokenizer.type).obj(config.tokenizer, ctx)
    started = time.perf_counter()
    data = load_datasets(ctx, tokenizer, config.data.max_length)
    seconds = time.perf_counter() - started
    store = data.train.store
    tokens = int(store.offsets("input_ids")[-1])
    print(json.dumps({"seconds": seconds, "rows": data.train_report.rows, "tokens": tokens,
                      "kept": len(data.train)}))
    """
)


def write_config(path: Path, rows: Path, model: Path, out: Path) -> Path:
    import yaml

    config = {
        "type": "sft",
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "data": {"sources": [str(rows)], "max_length": MAX_LENGTH, "num_proc": 2, "dl_num_workers": 0},
        "micro_batch_size": 2,
        "train_iters": 3,
        "optimizer": {"lr": 1e-4},
        "logger": {"output_dir": str(out)},
        "loss_log_interval": 1,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def rank_peaks(measured: dict, launcher_pid_count: int = 2) -> list[float]:
    """The two largest per-process peaks: the ranks (the launchers hold far less)."""
    return sorted(measured["each"].values(), reverse=True)[:launcher_pid_count]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--small-rows", type=int, default=2_000)
    parser.add_argument("--out", type=Path, default=Path("bench-out/data-scale"))
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    python = sys.executable

    from posttrain.tiny_model import write_tiny_model

    model = out / "model"
    if not (model / "config.json").is_file():
        write_tiny_model(model, seed=0, hidden_size=64, layers=2, vocab_size=2048)
    rows, small = out / f"chat-{args.rows}.jsonl", out / f"chat-{args.small_rows}.jsonl"
    if not rows.is_file():
        started = time.perf_counter()
        write_rows(rows, args.rows)
        print(
            f"generated {args.rows} rows in {time.perf_counter() - started:.0f} s ({rows.stat().st_size / 2**20:.0f} MiB)"
        )
    if not small.is_file():
        with open(rows) as source, open(small, "w") as target:
            for _, line in zip(range(args.small_rows), source, strict=False):
                target.write(line)

    results: dict[str, object] = {"rows": args.rows}
    big_config = write_config(out / "big.yaml", rows, model, out / "run-big")
    small_config = write_config(out / "small.yaml", small, model, out / "run-small")
    for path in (out / "run-big", out / "run-small"):
        subprocess.run(["rm", "-rf", str(path)], check=True)

    ours = run_measured([python, "-c", POSTTRAIN, str(big_config)], env)
    results["posttrain"] = {**ours["result"], "peak_rss_gib": ours["rss"], "peak_pss_gib": ours["pss"]}
    hit = run_measured([python, "-c", POSTTRAIN, str(big_config)], env)
    results["cache_hit_seconds"] = hit["result"]["seconds"]
    if not args.skip_baseline:
        cache = out / "hf-cache"
        subprocess.run(["rm", "-rf", str(cache)], check=True)
        base = run_measured([python, "-c", BASELINE, str(rows), str(model), str(cache), str(MAX_LENGTH)], env)
        results["baseline"] = {**base["result"], "peak_rss_gib": base["rss"], "peak_pss_gib": base["pss"]}

    from posttrain.data.packing import best_fit_bins

    lengths = np.random.default_rng(0).integers(10, MAX_LENGTH + 1, size=1_000_000)
    started = time.perf_counter()
    offsets, _ = best_fit_bins(lengths, 4 * MAX_LENGTH)
    results["pack_1m_seconds"] = time.perf_counter() - started
    results["pack_1m_fill"] = float(lengths.sum() / ((len(offsets) - 1) * 4 * MAX_LENGTH))

    if not args.skip_train:
        cli = [python, "-m", "posttrain", "train"]
        run_measured([python, "-c", POSTTRAIN, str(small_config)], env)  # build the small cache first
        big = run_measured([*cli, str(big_config), "--nproc", "2"], env)
        little = run_measured([*cli, str(small_config), "--nproc", "2"], env)
        results["train_rank_peak_rss_gib"] = {"big": rank_peaks(big), "small": rank_peaks(little)}

    (out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    ours = results["posttrain"]
    print(f"\n== data at scale: {results['rows']} chat rows, max_length {MAX_LENGTH}, num_proc 2 ==")
    print(f"posttrain build : {ours['rows'] / ours['seconds']:8.0f} rows/s {ours['tokens'] / ours['seconds']:10.0f} tokens/s"
          f"  peak RSS {ours['peak_rss_gib']:.2f} GiB (PSS {ours['peak_pss_gib']:.2f})  {ours['kept']} samples kept")  # fmt: skip
    if "baseline" in results:
        base = results["baseline"]
        print(f"baseline map    : {base['rows'] / base['seconds']:8.0f} rows/s {base['tokens'] / base['seconds']:10.0f} tokens/s"
              f"  peak RSS {base['peak_rss_gib']:.2f} GiB (PSS {base['peak_pss_gib']:.2f})  {base['kept']} samples kept")  # fmt: skip
        speed = (ours["rows"] / ours["seconds"]) / (base["rows"] / base["seconds"])
        print(
            f"ratio           : {speed:.2f}x the baseline's rows/s (goal >= 2); builder peak "
            f"{ours['peak_rss_gib'] / base['peak_rss_gib']:.2f}x the baseline's RSS (goal <= 1)"
        )
    print(f"cache hit       : opened in {results['cache_hit_seconds']:.2f} s")
    print(
        f"packing         : 1,000,000 samples best-fit in {results['pack_1m_seconds']:.1f} s "
        f"({results['pack_1m_fill']:.1%} full)"
    )
    if "train_rank_peak_rss_gib" in results:
        peaks = results["train_rank_peak_rss_gib"]
        big, small = max(peaks["big"]), max(peaks["small"])
        print(
            f"train ranks     : peak RSS per rank {', '.join(f'{x:.2f}' for x in peaks['big'])} GiB on "
            f"{results['rows']} rows vs {', '.join(f'{x:.2f}' for x in peaks['small'])} GiB on 2,000 rows: "
            f"{big / small:.2f}x (goal <= 1.2)"
        )


if __name__ == "__main__":
    main()
