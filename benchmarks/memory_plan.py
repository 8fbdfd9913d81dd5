"""The memory plan's estimate against the measured peak, for configs where tensors dominate.

    python benchmarks/memory_plan.py            # every CPU case (about 5 minutes on 2 cores)
    python benchmarks/memory_plan.py --quick    # the cases the test suite checks (with --jobs 2 there)
    python benchmarks/memory_plan.py --gpu      # on a GPU machine: the issue's three GPU cases as well

On CPU each case trains two steps with ``posttrain.run`` and measures the growth of the process's peak
resident memory (``VmHWM``, reset before each case) over its resident memory before the case, after one
warm-up run has paid the one-time costs; glibc is told to return freed blocks (``MALLOC_MMAP_THRESHOLD_``) so
cases do not reuse each other's memory. Two-process cases run under torchrun and report the larger rank.
The estimate compared is the plan's tensors on device and host (``MemoryPlan.tensors_peak``: the runtime
constant is already in the baseline). On a GPU the measurement is ``torch.cuda.max_memory_allocated`` over
the allocation before the case, against the plan's device peak less its runtime constant.

The GPU cases (``--gpu``; on CPU they are printed as estimates only): a 1.1B LLaMA at 128K and 256K tokens per
sample with tiled MLP, tiled loss and offloaded checkpoints (measured on one H100: 26.2 GiB allocated at 128K,
49.4 GiB reserved at 256K), and a Llama-8B shape at 128K with ZeRO 3, parameter and optimizer offload and
``cpu_adam`` (killed by the host's OOM killer on a 128 GB host: the plan should say it does not fit).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 2**20
#: (hidden, layers, heads): a 100M-parameter model (weights dominate) and a small one for long rows
MODELS = {"100m": (1024, 6, 16), "small": (256, 2, 4)}
BASE: dict[str, Any] = {
    "type": "causal",
    "model": {"dtype": "float32", "disable_activation_checkpoint": True},
    "data": {"text_column": "text", "pack_samples": False, "dl_num_workers": 0},
    "micro_batch_size": 1,
    "train_iters": 2,
    "optimizer": {"lr": 1e-4},
    "loss_log_interval": 0,
    "checkpoint": [],
    "check_memory": False,
}
#: the vision-language cases' LLaVA: a language model of width 64 behind a 6-layer image encoder of width 768
#: cutting its 32x32 images into 2x2 patches (256 image tokens an image)
VISION_TOWER = {"hidden": 768, "layers": 6, "patch": 2}
VISION: dict[str, Any] = {"type": "sft", "micro_batch_size": 2, "corpus": "vision"}


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for key, value in changes.items():
        out[key] = (
            merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


#: name -> (model, max_length, processes, config changes, in --quick)
CASES: dict[str, tuple[str, int, int, dict[str, Any], bool]] = {
    "100M ZeRO 0": ("100m", 512, 1, {}, False),
    "100M ZeRO 0 checkpointing": ("100m", 512, 1, {"model": {"disable_activation_checkpoint": False}}, False),
    "100M ZeRO 3": ("100m", 512, 1, {"deepspeed": {"zero_optimization": {"stage": 3}}}, True),
    "100M ZeRO 2, 2 processes": ("100m", 512, 2, {"deepspeed": {"zero_optimization": {"stage": 2}}}, True),
    "100M ZeRO 3, 2 processes": ("100m", 512, 2, {"deepspeed": {"zero_optimization": {"stage": 3}}}, False),
    "100M LoRA r=64": (
        "100m",
        2048,
        1,
        {"model": {"peft_config": {"peft_type": "LORA", "r": 64, "target_modules": "all-linear"}}},
        True,
    ),
    "8K plain loss": ("small", 8192, 1, {"tiled_loss_compute": False}, True),
    "8K tiled loss": ("small", 8192, 1, {"tiled_loss_compute": True}, False),
    "8K checkpointing": ("small", 8192, 1, {"model": {"disable_activation_checkpoint": False}}, True),
    "8K tiled MLP": ("small", 8192, 1, {"tiled_mlp_compute": True}, True),
    "8K checkpointing + tiled MLP": (
        "small",
        8192,
        1,
        {"model": {"disable_activation_checkpoint": False}, "tiled_mlp_compute": True},
        False,
    ),
    "8K packed, long documents": ("small", 8192, 1, {"data": {"pack_samples": True}, "corpus": "long"}, True),
    "8K packed SFT, short chats": ("small", 8192, 1, {"type": "sft", "data": {"pack_samples": True}}, False),
    # a vision-language model whose image encoder dominates: 3 images of 256 patches a row, 2 rows
    "VLM, tower frozen": ("vlm", 2048, 1, VISION, False),
    "VLM, tower trained": ("vlm", 2048, 1, merge(VISION, {"model": {"freeze_vision_tower": False}}), False),
    "VLM, tower trained, checkpointing": (
        "vlm",
        2048,
        1,
        merge(VISION, {"model": {"freeze_vision_tower": False, "disable_activation_checkpoint": False}}),
        False,
    ),
}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Free what can be freed, reset the peak (VmHWM), and return the resident memory now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS")


def case_config(name: str, work: Path) -> dict[str, Any]:
    model, length, _, changes, _ = CASES[name]
    config = merge(BASE, changes)
    corpus = config.pop("corpus", "text")
    config["model"]["name_or_path"] = str(work / model)
    config["data"]["max_length"] = length
    chat = config["type"] == "sft"
    source = f"{corpus}.jsonl" if corpus == "vision" or not chat else "chat.jsonl"
    config["data"]["sources"] = [str(work / source)]
    if chat:
        del config["data"]["text_column"]
    config["logger"] = {"output_dir": str(work / "runs" / name.replace(" ", "_").replace(",", ""))}
    return config


def prepare(work: Path) -> None:
    """The models and the data, written once."""
    from posttrain.testing.data import chat_rows, text_rows, write_jsonl
    from posttrain.testing.vision import colour_rows
    from posttrain.tiny_model import write_tiny_model
    from posttrain.vision.tiny import Tower, write_tiny_vlm

    for name, (hidden, layers, heads) in MODELS.items():
        if not (work / name).exists():
            write_tiny_model(work / name, hidden_size=hidden, layers=layers, heads=heads, vocab_size=2048)
    if not (work / "vlm").exists():
        write_tiny_vlm(work / "vlm", "llava", tower=Tower(**VISION_TOWER))
    if not (work / "vision.jsonl").exists():
        rows = colour_rows(work, 64)
        for index, row in enumerate(rows):  # three images a row: the question about the first
            others = [rows[(index + k) % len(rows)]["images"][0] for k in range(1, 3)]
            row["messages"][0]["content"][:0] = [{"type": "image"}] * 2
            row["images"] = row["images"] + others
        write_jsonl(work / "vision.jsonl", rows)
    if not (work / "long.jsonl").exists():
        write_jsonl(work / "text.jsonl", text_rows(3000))
        write_jsonl(work / "chat.jsonl", chat_rows(3000))
        # documents of 1K to 5K tokens, several to a packed row
        rng = random.Random(0)
        counts = [rng.randint(300, 1500) for _ in range(24)]
        write_jsonl(work / "long.jsonl", [{"text": " ".join(map(str, range(n)))} for n in counts])
        # for the GPU cases' rows of 128K and 256K tokens: documents of 4K to 16K tokens
        counts = [rng.randint(1500, 6000) for _ in range(160)]
        write_jsonl(work / "huge.jsonl", [{"text": " ".join(map(str, range(n)))} for n in counts])


def measure(config: dict[str, Any]) -> float:
    """The growth of this process's peak memory over its memory before training ``config``."""
    import torch

    from posttrain.config import load_config
    from posttrain.run import run

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_peak()
    result = run(load_config(data=config))
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")
    del result
    return float(peak - base)


def estimate(
    config: dict[str, Any], processes: int, machine: Any = None, read_data: bool = False
) -> tuple[float, Any]:
    """The plan's tensors for ``config`` on ``processes`` processes (rows as long as ``max_length``, or with
    ``read_data`` as the pre-flight reads them from the data: the longest row and its image tokens): on a
    GPU the device peak, on a CPU device and host together (the runtime constant left out: it is in the
    baseline); and the plan itself."""
    from posttrain.config import load_config
    from posttrain.memory.check import memory_plan
    from posttrain.memory.machine import detect
    from posttrain.plan import resolve
    from posttrain.preflight import longest_row, most_image_tokens, preflight

    machine = machine or detect(processes)
    if read_data:
        flight = preflight(load_config(data=config), processes)
        rows, images = longest_row(flight), most_image_tokens(flight)
        memory = memory_plan(flight.config, processes, machine, rows, images)
    else:
        resolved, _, _ = resolve(load_config(data=config), processes)
        memory = memory_plan(resolved, processes, machine, resolved.data.max_length)
    tensors = memory.peak("device", runtime=False) if machine.device == "cuda" else memory.tensors_peak()
    return tensors, memory


def warm_up(work: Path, out: Path) -> None:
    """One small run first: imports, thread pools and DeepSpeed's one-time set-up are in every baseline.
    It writes under the launch's own ``out`` (cases measured side by side do not share it)."""
    config = case_config("8K plain loss", work)
    config["data"]["max_length"] = 256
    config["logger"]["output_dir"] = str(out / "warmup")
    measure(config)


def worker(config_file: Path, work: Path, out: Path) -> None:
    """One case in this process (a rank of a torchrun launch, or the parent's own run)."""
    warm_up(work, out)
    growth = measure(json.loads(config_file.read_text()))
    rank = int(os.environ.get("RANK", "0"))
    (out / f"{rank}.json").write_text(json.dumps(growth))


def run_measured(config: dict[str, Any], processes: int, work: Path, threads: int = 2) -> float:
    """The measured growth of training ``config``, in a fresh process (or ``processes`` of them; the
    largest rank's), with ``threads`` OpenMP threads over all its processes."""
    out = Path(tempfile.mkdtemp(dir=work))
    (out / "config.json").write_text(json.dumps(config))
    from posttrain.dist import free_port
    from posttrain.testing.env import child_env

    # a child starts its own process group (never the caller's, when the caller is a test process)
    env = child_env(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(max(1, threads // processes)))
    me = [
        str(Path(__file__).resolve()),
        "--worker",
        str(out / "config.json"),
        "--work",
        str(work),
        "--out",
        str(out),
    ]
    if processes > 1:
        launch = ["--nproc_per_node", str(processes), f"--master_port={free_port()}"]
        command = [sys.executable, "-m", "torch.distributed.run", *launch, *me]
    else:
        command = [sys.executable, *me]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(
            f"{config['logger']['output_dir']} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return max(json.loads(p.read_text()) for p in out.glob("[0-9]*.json"))


def run_case(name: str, work: Path) -> tuple[float, float]:
    """(estimate, measured) bytes for one case."""
    return run_cases([name], work)[0]


def run_cases(names: list[str], work: Path, jobs: int = 1) -> list[tuple[float, float]]:
    """(estimate, measured) bytes for each case. The estimates are computed here one by one; the measured
    runs, each in fresh processes of its own, ``jobs`` at a time (a process's peak resident memory is its own,
    so running cases side by side changes their time, not what is measured)."""
    from concurrent.futures import ThreadPoolExecutor

    configs = {name: case_config(name, work) for name in names}
    estimates = [
        estimate(configs[name], CASES[name][2], read_data=CASES[name][0] == "vlm")[0] for name in names
    ]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        threads = max(1, 2 // max(1, jobs))  # the two cores these tables were measured on, shared
        measured = list(
            pool.map(lambda name: run_measured(configs[name], CASES[name][2], work, threads), names)
        )
    return list(zip(estimates, measured, strict=True))


#: the issue's GPU cases: LLaMA shape, tokens per row, what was measured (on one H100 80GB, 128 GB host)
GPU_SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=32768),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
}  # fmt: skip
LONG: dict[str, Any] = {
    "model": {"dtype": "bfloat16", "disable_activation_checkpoint": False},
    "data": {"pack_samples": True},
    "activation_checkpoint_cpu_offload": True,
    "tiled_mlp_compute": True,
    "tiled_loss_compute": True,
}
OFFLOAD = {
    "deepspeed": {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        }
    },
    "optimizer": {"type": "cpu_adam"},
}
GPU_CASES: dict[str, tuple[str, int, dict[str, Any], bool]] = {
    "1.1B, 128K tokens (issue: 26.2 GiB allocated)": ("1b", 131072, LONG, True),
    "1.1B, 256K tokens (issue: 49.4 GiB reserved)": ("1b", 262144, LONG, True),
    "Llama-8B shape, 128K, ZeRO 3 + offload, cpu_adam (issue: OOM-killed on a 128 GB host)": (
        "8b",
        131072,
        merge(LONG, OFFLOAD),
        False,  # estimate only
    ),
}


def _gpu_model(work: Path, shape: str, weights: bool) -> Path:
    """A config.json of the shape beside the small model's tokenizer; random bf16 weights when asked."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path = work / f"gpu-{shape}"
    config = AutoConfig.for_model(
        "llama", max_position_embeddings=262144, dtype="bfloat16", **GPU_SHAPES[shape]
    )
    if not path.exists():
        shutil.copytree(work / "small", path, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        config.save_pretrained(path)
    if weights and not any(path.glob("*.safetensors")):
        import torch

        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def gpu_cases(work: Path) -> list[str]:
    """The issue's GPU cases: each plan for one H100 80GB on a 128 GB host, and on a GPU machine the
    measurement of the two that ran there."""
    import torch

    from posttrain.memory.machine import Machine
    from posttrain.memory.report import gib, plan_text

    h100 = Machine("cuda", 80 * 10**9, 128 * 10**9, 1, "H100 80GB, 128 GB host (as in the issue)", True)
    cuda = torch.cuda.is_available()
    out = []
    for title, (shape, length, changes, measurable) in GPU_CASES.items():
        config = merge(BASE, changes)
        config["model"]["name_or_path"] = str(_gpu_model(work, shape, cuda and measurable))
        config["data"].update(sources=[str(work / "huge.jsonl")], max_length=length)
        config["logger"] = {"output_dir": str(work / "runs" / f"gpu-{shape}-{length}")}
        tensors, memory = estimate(config, 1, h100)
        lines = [f"\n== {title}", plan_text(memory, h100)]
        if cuda and measurable:
            measured = run_measured(config, 1, work)
            lines.append(
                f"measured here: {gib(measured)} allocated; estimate {gib(tensors)} ({tensors / measured - 1:+.1%})"
            )
        out.append("\n".join(lines))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="only the cases the test suite checks")
    parser.add_argument("--cases", help="case names separated by ; (default: all, or --quick's)")
    parser.add_argument("--gpu", action="store_true", help="print the GPU cases' plans (estimates)")
    parser.add_argument("--json", type=Path, help="write the table here")
    parser.add_argument(
        "--jobs", type=int, default=1, help="cases measured at once (each in its own processes; default 1)"
    )
    parser.add_argument("--work", type=Path, help="where models, data and runs go (default: a temporary dir)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = args.work or Path(tempfile.mkdtemp(prefix="memory-plan-"))
    if args.worker:
        worker(Path(args.worker), work, args.out)
        return 0
    prepare(work)
    names = args.cases.split(";") if args.cases else [n for n, c in CASES.items() if c[4] or not args.quick]
    gpus = torch.cuda.device_count()
    if gpus:  # one process per GPU
        names = [name for name in names if CASES[name][2] <= gpus]
    rows = []
    print(f"{'case':<34} {'estimate':>10} {'measured':>10} {'error':>7}", flush=True)
    for name, (estimated, measured) in zip(names, run_cases(names, work, args.jobs), strict=True):
        error = estimated / measured - 1
        rows.append({"case": name, "estimate_bytes": estimated, "measured_bytes": measured, "error": error})
        print(f"{name:<34} {estimated / MIB:>8.0f}Mi {measured / MIB:>8.0f}Mi {error:>+7.1%}", flush=True)
    if args.gpu:
        print("\n".join(gpu_cases(work)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
