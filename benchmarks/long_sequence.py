"""Long sequences: peak memory of one training step of a small LLaMA (vocabulary 32K) with each memory
feature off and on, and per rank with sequence parallelism.

    python benchmarks/long_sequence.py [--lengths 16384 32768 65536] [--longest 131072] [--out DIR]

Model: LLaMA, vocabulary 32,000, hidden 128, 1 decoder layer (with checkpointing, more layers add only
their saved inputs), 4 heads (2 key/value heads), MLP 512, fp32 on the
CPU, activation checkpointing on (the default). Each configuration runs ``posttrain train``'s own code path
(``run.run``: causal data of one block of exactly N tokens, micro-batch 1, one optimizer step, AdamW) in a
fresh process. RSS is sampled every 5 ms during the step; "above the model" is the step's peak RSS minus
the RSS when the step starts (model, data, DeepSpeed engine already built). A process that passes
``--limit-gib`` is stopped and reported as over the limit. Configurations, per length:

- plain: no tiling;
- tiled loss: ``tiled_loss_compute: true``;
- tiled MLP: ``tiled_mlp_compute: true``;
- tiled MLP + loss: both (the goal: at most 0.3x of plain at 32K);
- all on: both + ``activation_checkpoint_cpu_offload: true``;
- SP=2 (at the middle length, plain and everything on): two processes (``sequence_parallel_size: 2``)
  against that length's one-process row, each rank's peak (the goal: at most 0.6x).

``--longest`` tries longer sequences with everything on (and SP=2) to report the longest that trains.
Ratios are against the plain step (or SP=1) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VOCAB = 32_000
GIB = 2**30

FEATURES: dict[str, dict[str, Any]] = {
    "plain": {"tiled_loss_compute": False},
    "tiled loss": {"tiled_loss_compute": True},
    "tiled MLP": {"tiled_loss_compute": False, "tiled_mlp_compute": True},
    "tiled MLP + loss": {"tiled_loss_compute": True, "tiled_mlp_compute": True},
    "all on": {
        "tiled_loss_compute": True,
        "tiled_mlp_compute": True,
        "activation_checkpoint_cpu_offload": True,
    },
}


# ---------------------------------------------------------------------------------------------- the child


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StepMemory:
    """An observer of the loop: samples RSS while the first step runs; stops the process over a limit."""

    def __init__(self, limit: float, out: Path) -> None:
        self.limit, self.out = limit, out
        self.start = self.peak = 0
        self.began = 0.0
        self.running = False

    def _sample(self) -> None:
        while self.running:
            now = rss()
            self.peak = max(self.peak, now)
            if self.limit and now > self.limit * GIB:
                self.out.write_text(json.dumps({"over_limit": True, "start_gib": self.start / GIB}))
                os._exit(3)
            time.sleep(0.005)

    def step_started(self, step: int) -> None:
        if step == 1:
            self.start = self.peak = rss()
            self.began = time.perf_counter()
            self.running = True
            threading.Thread(target=self._sample, daemon=True).start()

    def step_finished(self, step: int) -> None:
        if step == 1:
            self.running = False
            self.peak = max(self.peak, rss())
            self.out.write_text(
                json.dumps(
                    {
                        "start_gib": self.start / GIB,
                        "peak_gib": self.peak / GIB,
                        "above_gib": (self.peak - self.start) / GIB,
                        "step_s": time.perf_counter() - self.began,
                    }
                )
            )

    def close(self) -> None:
        pass


def child(config_path: Path, out_dir: Path, limit: float) -> None:
    import posttrain.run as run_module
    from posttrain.config import load_config

    rank = int(os.environ.get("RANK", "0"))
    memory = StepMemory(limit, out_dir / f"rank{rank}.json")
    plain_observers = run_module.profiling_observers
    run_module.profiling_observers = lambda *args: [*plain_observers(*args), memory]
    history = run_module.run(load_config(config_path)).state.history
    if rank == 0:
        record = json.loads(memory.out.read_text())
        record["loss"] = history[0]["loss"]
        memory.out.write_text(json.dumps(record))


# --------------------------------------------------------------------------------------------- the parent


def write_inputs(root: Path, lengths: list[int]) -> tuple[Path, dict[int, Path]]:
    from posttrain.tiny_model import build_model, build_tokenizer
    from posttrain.utils.fs import atomic_dir

    model_dir = root / "model"
    if not model_dir.exists():
        tokenizer = build_tokenizer(vocab_size=2048)
        model = build_model(VOCAB, hidden_size=128, layers=1, heads=4, max_position_embeddings=2**20)
        with atomic_dir(model_dir) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = {}
    for length in lengths:
        path = root / f"text-{length}.jsonl"
        if not path.exists():
            path.write_text(json.dumps({"text": exact_text(tokenizer, length - 2)}) + "\n")  # + BOS and EOS
        texts[length] = path
    return model_dir, texts


def exact_text(tokenizer: Any, tokens: int) -> str:
    """Text of exactly ``tokens`` tokens (common words, one token each), so the causal data is one block of
    the measured length."""
    words = ["the", "and", "of", "a"]
    text = " ".join(words[i % 4] for i in range(tokens))
    count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if count != tokens:
        raise RuntimeError(f"the text has {count} tokens, not {tokens}")
    return text


def config_for(model_dir: Path, text: Path, length: int, features: dict[str, Any], out: Path) -> dict:
    return {
        "type": "causal",
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "data": {
            "sources": [str(text)],
            "max_length": length,
            "dl_num_workers": 0,
            "cache_dir": str(out / "data-cache"),
        },
        "micro_batch_size": 1,
        "train_iters": 1,
        "loss_log_interval": 0,
        "eval_at_end": False,
        "logger": {"output_dir": str(out / "runs" / f"{length}")},
        **features,
    }


def measure(name: str, config: dict, out: Path, nproc: int, limit: float) -> dict[str, Any]:
    folder = out / "results" / name.replace(" ", "_").replace("+", "and")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    script = [str(Path(__file__).resolve()), "--child", str(path), "--child-out", str(folder)]
    script += ["--limit-gib", str(limit)]
    if nproc == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    ranks = [
        json.loads((folder / f"rank{r}.json").read_text())
        for r in range(nproc)
        if (folder / f"rank{r}.json").exists()
    ]
    result: dict[str, Any] = {"name": name, "nproc": nproc, "wall_s": time.perf_counter() - started}
    if done.returncode != 0 and not any(r.get("over_limit") for r in ranks):
        result["error"] = (done.stdout[-1500:] + done.stderr[-3000:]).strip()
    result["ranks"] = ranks
    print(f"  {name:<28} {describe(result)}", flush=True)
    return result


def describe(result: dict[str, Any]) -> str:
    ranks = result["ranks"]
    if result.get("error"):
        return "failed: " + result["error"].splitlines()[-1][:200]
    if any(r.get("over_limit") for r in ranks):
        return "over the memory limit"
    above = ", ".join(f"{r['above_gib']:.2f}" for r in ranks)
    return f"above model {above} GiB, peak {max(r['peak_gib'] for r in ranks):.2f} GiB, step {ranks[0]['step_s']:.0f} s"


def above(result: dict[str, Any]) -> float | None:
    ranks = result["ranks"]
    if result.get("error") or not ranks or any(r.get("over_limit") for r in ranks):
        return None
    return max(r["above_gib"] for r in ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[16384, 32768, 65536])
    parser.add_argument("--longest", type=int, nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "long-sequence")
    parser.add_argument("--limit-gib", type=float, default=20.0)
    parser.add_argument("--child", type=Path)
    parser.add_argument("--child-out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.child:
        child(args.child, args.child_out, args.limit_gib)
        return
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir, texts = write_inputs(out, sorted({*args.lengths, *args.longest}))
    report: dict[str, Any] = {"lengths": {}, "sequence_parallel": {}, "longest": {}}
    for length in args.lengths:
        print(f"{length} tokens", flush=True)
        rows = {}
        for name, features in FEATURES.items():
            config = config_for(model_dir, texts[length], length, features, out)
            rows[name] = measure(f"{length} {name}", config, out, 1, args.limit_gib)
        report["lengths"][length] = rows
    middle = args.lengths[len(args.lengths) // 2] if args.lengths else None
    if middle is not None:
        print(f"sequence parallelism at {middle} tokens", flush=True)
    for name in ("plain", "all on") if middle is not None else ():
        config = config_for(
            model_dir, texts[middle], middle, {**FEATURES[name], "sequence_parallel_size": 2}, out
        )
        report["sequence_parallel"][name] = {
            1: report["lengths"][middle][name],
            2: measure(f"{middle} {name} SP=2", config, out, 2, args.limit_gib),
        }
    for length in args.longest:
        print(f"longest: {length} tokens, everything on, SP=2", flush=True)
        features = {**FEATURES["all on"], "sequence_parallel_size": 2}
        config = config_for(model_dir, texts[length], length, features, out)
        report["longest"][length] = measure(f"{length} all on SP=2", config, out, 2, args.limit_gib)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print_summary(report)


def print_summary(report: dict[str, Any]) -> None:
    print("\npeak memory above the model, ratio to the plain step of the same length")
    for length, rows in report["lengths"].items():
        plain = above(rows["plain"])
        cells = []
        for name, result in rows.items():
            value = above(result)
            ratio = f"{value / plain:.2f}x" if value is not None and plain else "-"
            cells.append(
                f"{name}: {value:.2f} GiB ({ratio})" if value is not None else f"{name}: did not fit"
            )
        print(f"  {length}: " + "; ".join(cells))
    for name, pair in report["sequence_parallel"].items():
        one, two = above(pair[1]), above(pair[2])
        if one and two:
            peak_one = max(r["peak_gib"] for r in pair[1]["ranks"])
            peak_two = max(r["peak_gib"] for r in pair[2]["ranks"])
            print(
                f"{name}, SP=2 per rank vs SP=1: above the model {two:.2f} vs {one:.2f} GiB ({two / one:.2f}x); "
                f"peak {peak_two:.2f} vs {peak_one:.2f} GiB ({peak_two / peak_one:.2f}x)"
            )
    for length, result in report["longest"].items():
        print(f"longest: {length} tokens with everything on and SP=2: {describe(result)}")


if __name__ == "__main__":
    main()
