"""Training throughput of posttrain against bare PyTorch loops (and TRL where installed) on the same data.

    python benchmarks/gpu_throughput.py --size 1b --seq-len 8192 --steps 20 \
        --runners bare,posttrain,trl --modes packed,padding-free,padded,compile --json out.json

A random LLaMA of the chosen size is written locally (no download), with synthetic chats whose lengths
spread as real chats do (log-normal, mean ``--mean-tokens``). Every runner trains micro-batch 1 x
``--accumulation`` steps of ``--seq-len``-token rows in bf16 on a GPU (fp32 on CPU) and reports tokens/s,
MFU (model FLOPs: ``posttrain/tracking/flops.py``, attention counted per document) and peak memory, each in a
fresh process. The runners:

- ``bare-bf16``: bf16 parameters, torch's fused AdamW, every row one causal sequence (the speed limit);
- ``bare-bf16-master``: bf16 parameters with float32 master weights and float32 gradient accumulation, the
  fused AdamW stepping the masters (posttrain's numerics: DeepSpeed's BF16_Optimizer on one process);
- ``posttrain``: ``posttrain train`` on a config per mode (packed, padding-free, padded; compile: packed with
  ``model.compile``; fp8 and fp8-compile: packed with ``model.fp8: tensorwise``, eager or compiled), the same
  rows in the same order as the bare loops;
- ``trl``: TRL's SFTTrainer with packing (skipped when TRL is not installed).

Ratios are against ``bare-bf16`` measured in the same invocation; each posttrain mode also gets its memory
plan (``posttrain/memory``: the device peak less the runtime constant, for rows of ``--seq-len`` tokens)
beside its measured peak (``torch.cuda.max_memory_allocated``; on a CPU the process's resident memory, which
the plan does not estimate alone). A runner that fails is printed with its error
and the script exits with status 1 after the others have run. ``--size tiny`` runs on the CPU in under a
minute (a test runs it). On a GPU machine without network: see README, "GPU throughput benchmark".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 2048},
    "1b": {"hidden_size": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 32768},
    "8b": {"hidden_size": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256},
}
#: mode -> (packed rows, padding-free rows, model.compile, model.fp8)
MODES: dict[str, tuple[bool, bool, bool, str | None]] = {
    "packed": (True, False, False, None),
    "padding-free": (False, True, False, None),
    "padded": (False, False, False, None),
    "compile": (True, False, True, None),
    "fp8": (True, False, False, "tensorwise"),
    "fp8-compile": (True, False, True, "tensorwise"),
}
RUNNERS = ("bare", "bare-bf16", "posttrain", "trl")  # bare: bare-bf16 and bare-bf16-master
WARMUP = 2  # steps left out of the timing (allocation, compilation)


# ------------------------------------------------------------------ the work


def write_model(work: Path, size: str, seq_len: int) -> Path:
    """A random LLaMA of ``size`` and a local BPE tokenizer, written once per work directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.tiny_model import build_tokenizer

    out = work / f"model-{size}"
    if (out / "config.json").is_file():
        return out
    shape = SIZES[size]
    tokenizer = build_tokenizer(vocab_size=min(shape["vocab"], 8192))
    config = LlamaConfig(
        vocab_size=max(shape["vocab"], len(tokenizer)),
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max(seq_len, 2048),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_chats(path: Path, count: int, mean_tokens: int, seed: int = 0) -> Path:
    """Chats of 1-3 exchanges whose lengths are log-normal around ``mean_tokens`` (sigma 0.6: most chats
    between half and twice the mean, a long tail), words from the tiny tokenizer's vocabulary."""
    from posttrain.tiny_model import _WORDS

    rng = np.random.default_rng(seed)
    words = np.array(sorted(_WORDS))
    lengths = rng.lognormal(np.log(mean_tokens) - 0.18, 0.6, size=count).astype(int).clip(32)
    with open(path, "w", encoding="utf-8") as handle:
        for total in lengths:
            turns = int(rng.integers(1, 4))
            per_message = max(4, int(total) // (2 * turns) // 2)  # about two tokens a word
            messages = [
                {"role": role, "content": " ".join(words[rng.integers(0, len(words), per_message)].tolist())}
                for _ in range(turns)
                for role in ("user", "assistant")
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def posttrain_config(work: Path, model: Path, chats: Path, args: Any, mode: str) -> dict[str, Any]:
    """The run of one mode: micro-batch 1 row of ``seq_len`` tokens (packed), or the same token budget as
    micro-batches of whole chats (padding-free, padded)."""
    cuda = torch.cuda.is_available()
    packed, padding_free, compile_, fp8 = MODES[mode]
    micro = 1 if packed else max(1, args.seq_len // args.mean_tokens)
    return {
        "model": {
            "name_or_path": str(model),
            "dtype": "bfloat16" if cuda else "float32",
            "disable_activation_checkpoint": True,
            "compile": compile_,
            "fp8": fp8,
        },
        "data": {
            "sources": [str(chats)],
            "max_length": args.seq_len,
            "pack_samples": packed,
            "padding_free": padding_free,
            "overlong_samples": "truncate",
            "dl_num_workers": 1,
            "cache_dir": str(work / "data-cache"),
        },
        "micro_batch_size": micro,
        "gradient_accumulation_steps": args.accumulation,
        "train_iters": args.steps,
        "optimizer": {"type": "adamw", "lr": 1e-5},
        "scheduler": {"warmup_ratio": 0.0},
        "loss_log_interval": 0,
        "logger": {"output_dir": str(work / f"run-{mode}"), "progress_bar": False},
        "seed": 0,
    }


# ------------------------------------------------------------------ runners (each in its own process)


def run_posttrain(config_path: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "posttrain", "train", str(config_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=_env())
    if done.returncode:
        raise RuntimeError(f"posttrain failed:\n{done.stderr[-3000:]}")
    config = json.loads(config_path.read_text())
    metrics = Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "step_time" in r][WARMUP:]
    memory = max(r.get("memory_peak_gib", r.get("memory_rss_gib", 0.0)) for r in records)
    return _result(sum(r["step_time"] for r in steps), sum(_tokens(r) for r in steps), memory, steps)


def _tokens(record: dict[str, Any]) -> int:
    """A step's input tokens, read back from its rate and time (a whole number: the product's rounding
    error, e.g. 4060.0000000000005, is not a token)."""
    return round(record["tokens_per_second"] * record["step_time"])


def bare(config_path: Path, masters: bool) -> dict[str, Any]:
    """A hand-written loop over posttrain's own batches (same rows, same order): every row one causal
    sequence (no document masking), summed NLL per token, torch AdamW (fused on CUDA); with ``masters``,
    float32 master weights take the update and accumulate the gradients (the standard mixed precision)."""
    from torch.utils.data import DataLoader

    from posttrain.config import load_config
    from posttrain.data.collate import Collator
    from posttrain.data.sampler import ShardSampler
    from posttrain.preflight import preflight

    config = load_config(config_path)
    plan = preflight(config, 1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    collate = Collator(plan.tokenizer.pad_token_id or 0, config.data.padding_free)
    sampler = ShardSampler(len(plan.data.train), 1, 0, seed=config.data.seed)
    loader = DataLoader(
        plan.data.train, batch_size=config.micro_batch_size, sampler=sampler, collate_fn=collate
    )
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(config.model.name_or_path, dtype=dtype).to(device).train()
    params = list(model.parameters())
    updated = [p.detach().float().clone() for p in params] if masters else params
    for master in updated if masters else ():
        master.grad = torch.zeros_like(master)
    optimizer = torch.optim.AdamW(updated, lr=1e-5, fused=cuda)
    batches = iter(loader)
    times, tokens, steps = [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(config.train_iters):
        started = time.perf_counter()
        micro = [next(batches) for _ in range(config.gradient_accumulation_steps)]
        units = sum(m["num_target_tokens"] for m in micro)
        for batch in micro:
            ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            mask = batch.get("attention_mask")
            logits = model(input_ids=ids, attention_mask=None if mask is None else mask.to(device)).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum"
            )
            (loss / units).backward()
            if masters:  # accumulate in float32, free the 16-bit gradients
                torch._foreach_add_([m.grad for m in updated], [p.grad.float() for p in params])
                model.zero_grad(set_to_none=True)
        torch.nn.utils.clip_grad_norm_(updated, 1.0, foreach=True)
        optimizer.step()
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(params, updated)
            torch._foreach_zero_([m.grad for m in updated])
        else:
            optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
            tokens.append(sum(m["num_input_tokens"] for m in micro))
            steps.append({"attention_sq": sum(m["num_attention_sq"] for m in micro)})
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else _rss_gib()
    result = _result(sum(times), sum(tokens), memory, steps)
    result["full_row_attention"] = True  # the speed limit attends over whole rows
    return result


def run_trl(work: Path, model: Path, chats: Path, args: Any) -> dict[str, Any]:
    """TRL's SFTTrainer, packing (BFD) to ``seq_len``, micro-batch 1 x the same accumulation."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    dataset = load_dataset("json", data_files=str(chats), split="train")
    trl_args = SFTConfig(
        output_dir=str(work / "run-trl"),
        max_length=args.seq_len,
        packing=True,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=1e-5,
        bf16=cuda,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        include_num_input_tokens_seen=True,
        dataloader_num_workers=1,
    )
    trainer = SFTTrainer(model=str(model), args=trl_args, train_dataset=dataset)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - started
    tokens = int(trainer.state.num_input_tokens_seen)
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else _rss_gib()
    result = _result(elapsed, tokens, memory, [])
    result["note"] = "whole run timed (warm-up included); TRL's own packing"
    return result


def _result(seconds: float, tokens: float, memory: float, steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "peak_memory_gib": memory,
        "steps_timed": len(steps),
    }


def _rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    return env


# ------------------------------------------------------------------ MFU and the driver


def flops_of(model_dir: Path) -> Any:
    """The model's FLOPs model (``tracking/flops.py``), counted on the meta device: no weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.tracking.flops import flops_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return flops_model(model, recompute=False)


def mfu(
    flops: Any, result: dict[str, Any], attention_sq_per_token: float, peak: float | None
) -> float | None:
    """Model FLOPs per second over the device's peak, attention per document."""
    if not peak or not result["tokens"]:
        return None
    per_token = flops.model_flops(1, 0) + flops.model_flops(0, 1) * attention_sq_per_token
    return per_token * result["tokens_per_second"] / 1e12 / peak


def child(args: Any) -> None:
    """One runner in this process; its result as JSON on the last line."""
    work = Path(args.work)
    config_path = work / f"config-{args.mode}.json"
    if args.child == "posttrain":
        result = run_posttrain(config_path)
    elif args.child in ("bare-bf16", "bare-bf16-master"):
        result = bare(config_path, masters=args.child == "bare-bf16-master")
    else:
        result = run_trl(work, Path(args.model), Path(args.chats), args)
    print(json.dumps(result))


def _spawn(args: Any, runner: str, mode: str, model: Path, chats: Path) -> dict[str, Any] | None:
    command = [
        sys.executable,
        __file__,
        "--child",
        runner,
        "--mode",
        mode,
        "--work",
        str(args.work),
        "--model",
        str(model),
        "--chats",
        str(chats),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--accumulation",
        str(args.accumulation),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=_env())
    if done.returncode:
        print(f"{runner} ({mode}) failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: 512 tiny, 8192)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 6 tiny, 20)")
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--mean-tokens", type=int, default=None, help="mean chat length (default seq-len/3)")
    parser.add_argument(
        "--rows", type=int, default=None, help="chats to write (default: enough for the steps)"
    )
    parser.add_argument("--runners", default="bare,posttrain,trl")
    parser.add_argument("--modes", default="packed,padding-free,padded,compile,fp8-compile")
    parser.add_argument("--work", default="bench-out/gpu-throughput")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: detected)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chats", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tiny = args.size == "tiny"
    args.seq_len = args.seq_len or (512 if tiny else 8192)
    args.steps = args.steps or (6 if tiny else 20)
    args.mean_tokens = args.mean_tokens or args.seq_len // 3
    if args.child:
        return child(args)
    run_all(args)


def run_all(args: Any) -> None:
    from posttrain.tracking.flops import peak_tflops

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(runners) - set(RUNNERS)) + sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown runners or modes: {', '.join(unknown)}")
    model = write_model(work, args.size, args.seq_len)
    rows = args.rows or max(64, 3 * args.steps * args.accumulation * args.seq_len // args.mean_tokens)
    chats = write_chats(work / "chats.jsonl", rows, args.mean_tokens)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = peak_tflops(args.peak_tflops, device, torch.bfloat16)
    results: dict[str, Any] = {"facts": _facts(args), "results": {}}
    for mode in modes:
        (work / f"config-{mode}.json").write_text(
            json.dumps(posttrain_config(work, model, chats, args, mode))
        )
    attention = _attention_per_token(work, modes[0]) if modes else 0.0
    flops = flops_of(model)
    plan: list[tuple[str, str]] = []
    if "bare" in runners or "bare-bf16" in runners:
        plan.append(("bare-bf16", modes[0]))
    if "bare" in runners:
        plan.append(("bare-bf16-master", modes[0]))
    if "posttrain" in runners:
        plan += [("posttrain", mode) for mode in modes]
    if "trl" in runners:
        try:
            import trl  # noqa: F401

            plan.append(("trl", "packed"))
        except ImportError:
            print("trl is not installed: its runner is skipped", file=sys.stderr)
    failed = []
    for runner, mode in plan:
        result = _spawn(args, runner, mode, model, chats)
        if result is None:
            failed.append(f"{runner}/{mode}")
            continue
        result["mfu"] = mfu(flops, result, attention, peak)
        if runner == "posttrain":
            result["plan_gib"] = planned_gib(work / f"config-{mode}.json")
            result["plan_error"] = result["plan_gib"] / result["peak_memory_gib"] - 1
        results["results"][f"{runner}/{mode}"] = result
        results["failed"] = failed
        if args.json:  # after every runner: a run stopped at a time limit keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
    results["failed"] = failed
    _print(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if failed:  # each printed above with its error
        raise SystemExit(f"{len(failed)} runner(s) failed: {', '.join(failed)}")


def planned_gib(config_path: Path) -> float:
    """The memory plan's estimate for a mode's config, one process, rows of ``max_length`` tokens (what the
    measured peak is compared with: the device's tensors on a GPU, every tensor on a CPU)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from memory_plan import estimate

    tensors, _ = estimate(json.loads(config_path.read_text()), 1)
    return tensors / 2**30


def _attention_per_token(work: Path, mode: str) -> float:
    """Sum of squared document lengths per token in the packed rows (for MFU): the data's, not a row's."""
    from posttrain.config import load_config
    from posttrain.preflight import preflight

    config = load_config(work / f"config-{mode}.json")
    plan = preflight(config, 1)
    lengths = plan.data.train.store.lengths("input_ids")  # one stored sample per chat
    return float((lengths.astype(np.float64) ** 2).sum() / lengths.sum())


def _facts(args: Any) -> dict[str, Any]:
    facts = {
        "size": args.size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "accumulation": args.accumulation,
        "mean_tokens": args.mean_tokens,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        facts["device"] = torch.cuda.get_device_name()
    return facts


def _print(results: dict[str, Any]) -> None:
    rows = results["results"]
    base = rows.get(next((k for k in rows if k.startswith("bare-bf16")), ""), {}).get("tokens_per_second")
    print(json.dumps(results["facts"]))
    print(
        f"{'runner/mode':32} {'tokens/s':>12} {'x bare-bf16':>12} {'MFU':>8} {'peak GiB':>9} {'plan GiB':>9}"
    )
    for name, result in rows.items():
        ratio = result["tokens_per_second"] / base if base else float("nan")
        share = f"{result['mfu']:.1%}" if result.get("mfu") is not None else "-"
        planned = f"{result['plan_gib']:9.2f}" if "plan_gib" in result else f"{'-':>9}"
        print(
            f"{name:32} {result['tokens_per_second']:12,.0f} {ratio:12.2f} {share:>8} "
            f"{result['peak_memory_gib']:9.2f} {planned}"
        )


if __name__ == "__main__":
    main()
