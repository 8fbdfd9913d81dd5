"""A pool of ``posttrain vllm-serve`` servers on this machine's CPU (vLLM's CPU build), measured in one run:

1. The weight push of one update against model size, split as the run does it (``VLLMServerEngine.push``):
   gather (the training weights as host tensors, ``named_weights``), write (one safetensors file under
   ``/dev/shm``) and load (the server's reload through posttrain's worker method and its prefix-cache reset),
   to one server and to two; the median of ``--pushes`` pushes after a first one.
2. Generation (on ``--generation-sizes``): completions per second and tokens per second through ``ServerPool.complete`` with one server
   on every core, and with two servers on half the cores each (the same cores in all), each completion
   ``--tokens`` tokens long (no stop token), from ``--completions`` prompts of 16 random tokens, seeded as a
   run seeds them. The ratio is two servers over one.
3. A LoRA run's push (on ``--lora-size``, r 16 on every linear layer): the adapter alone through vLLM's LoRA
   loading against the merged weights, bytes and seconds, to one server started for the LoRA config.

    .venv-vllm/bin/python benchmarks/server_pool.py [--sizes 100m,1b] [--completions 256] [--tokens 64]
        [--generation-sizes 100m] [--lora-size 100m]

Models: random LLaMAs written locally, float32 (``100m``: hidden 640, 12 layers, vocabulary 32,768, the 108M
model of ``grpo_step.py``; ``1b``: hidden 2048, 16 layers, vocabulary 32,768, the largest whose trainer copy,
written file and two servers fit this machine's 24 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SIZES = {
    "100m": {"hidden_size": 640, "layers": 12, "heads": 10, "vocab_size": 32768},
    "1b": {"hidden_size": 2048, "layers": 16, "heads": 16, "vocab_size": 32768},
}


def serve_config(work: Path, model: Path, ports: list[int]) -> Path:
    import yaml

    (work / "prompts.jsonl").write_text(json.dumps({"prompt": "reverse 123"}) + "\n")
    config = {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "data": {"sources": [str(work / "prompts.jsonl")], "max_length": 32},
        "rewards": [{"type": "length_penalty"}],
        "max_completion_length": 96,
        "micro_batch_size": 64,
        "use_vllm": True,
        "vllm_mode": "server",
        "vllm_server_base_url": [f"http://127.0.0.1:{port}" for port in ports],
    }
    path = work / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def pushes(
    model_dir: Path, urls: list[str], count: int, lora: dict[str, Any] | None = None, adapter: bool = True
) -> dict[str, float]:
    """Median seconds of each part of a push to ``urls`` (after one first push); ``lora``: a LoRA model with
    that PEFT config, its adapter pushed alone (``adapter``) or merged."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.generation.vllm_server import VLLMServerEngine

    model = SimpleNamespace(
        name_or_path=str(model_dir), peft_config=lora, peft_pretrained=None, quantization_config=None
    )
    config = SimpleNamespace(
        vllm_server_base_url=urls,
        vllm_server_timeout=600.0,
        request_timeout=600.0,
        weight_sync_timeout=1800.0,
        vllm_push_adapter=adapter,
        vllm_enable_sleep_mode=False,
        model=model,
    )
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        from peft import get_peft_model

        from posttrain.config.peft import peft_config_from_dict

        module = get_peft_model(module, peft_config_from_dict(lora))
    backend = VLLMServerEngine(config, module, [], SimpleNamespace(is_main=True, rank=0, world_size=1), 64)
    parts: dict[str, list[float]] = {}
    for index in range(count + 1):
        with torch.no_grad():  # new weights each time, as after an update
            next(p for p in module.parameters() if p.requires_grad).add_(1e-6)
        backend.push(module)
        if index:
            for key, value in backend.push_seconds.items():
                parts.setdefault(key, []).append(value)
    backend.close()
    params = sum(p.numel() for p in module.parameters())
    out = {key: statistics.median(values) for key, values in parts.items()}
    return {**out, "params": float(params), "total": out["gather"] + out["write"] + out["load"]}


def generation(urls: list[str], completions: int, tokens: int) -> dict[str, float]:
    """Completions and tokens per second through the pool (after a warm-up call)."""
    from posttrain.generation.server_pool import ServerPool
    from posttrain.generation.types import Sampling
    from posttrain.generation.vllm_server import completion_body

    pool = ServerPool(urls, 600.0, 600.0, 1800.0, main=True)
    served = pool.start(lambda client: client.call("/v1/models")["data"][0]["id"])
    pool.confirm("", ask=False)  # the servers' weights as they are: no push in this measurement
    rng = random.Random(0)
    sampling = Sampling(tokens, 1.0)
    bodies = [
        completion_body(served, [rng.randrange(3, 500) for _ in range(16)], sampling, [], 1000 + i, False)
        for i in range(completions)
    ]
    for body in bodies:
        body["ignore_eos"] = True  # every completion the same length
    pool.complete(bodies[:16], "warming up")
    started = time.perf_counter()
    answers = pool.complete(bodies, "generating")
    seconds = time.perf_counter() - started
    pool.close()
    made = sum(len(answer["choices"][0]["token_ids"]) for answer in answers)
    return {"seconds": seconds, "completions_per_s": completions / seconds, "tokens_per_s": made / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100m,1b")
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--generation-sizes", default="100m", help="the sizes generation is measured on")
    parser.add_argument("--lora-size", default="100m", help="the size the LoRA push is measured on")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from posttrain.dist import free_port
    from posttrain.generation.vllm_engine import usable_cores
    from posttrain.testing.served import vllm_server
    from posttrain.tiny_model import write_tiny_model

    cores = usable_cores()
    halves = [cores[: len(cores) // 2], cores[len(cores) // 2 :]]
    results: dict[str, Any] = {"cores": cores}
    with tempfile.TemporaryDirectory(prefix="posttrain-pool-bench-") as tmp:
        work = Path(tmp)
        for size in args.sizes.split(","):
            model = write_tiny_model(work / size, seed=0, **SIZES[size])
            ports = [free_port(), free_port()]
            path = serve_config(work, model, ports)
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            print(f"{size}: pushes and generation ...", file=sys.stderr, flush=True)
            with vllm_server(path, work / f"{size}-one.log", ports[0], cores=cores):
                one_push = pushes(model, urls[:1], args.pushes)
                generates = size in args.generation_sizes.split(",")
                one_gen = generation(urls[:1], args.completions, args.tokens) if generates else {}
            with (
                vllm_server(path, work / f"{size}-a.log", ports[0], cores=halves[0]),
                vllm_server(path, work / f"{size}-b.log", ports[1], cores=halves[1]),
            ):
                two_push = pushes(model, urls, args.pushes)
                two_gen = generation(urls, args.completions, args.tokens) if generates else {}
            results[size] = {
                "push_one": one_push,
                "push_two": two_push,
                "gen_one": one_gen,
                "gen_two": two_gen,
            }
            report(size, results[size], cores, halves)
            if size == args.lora_size:
                results["lora"] = lora_pushes(work, model, args.pushes, cores)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def lora_pushes(work: Path, model: Path, count: int, cores: list[int]) -> dict[str, Any]:
    """A LoRA model's push to one server: the adapter alone against the merged weights."""
    import yaml

    from posttrain.dist import free_port
    from posttrain.testing.served import vllm_server

    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    port = free_port()
    config = yaml.safe_load((work / "serve.yaml").read_text())
    config["model"]["peft_config"] = lora
    config["vllm_server_base_url"] = f"http://127.0.0.1:{port}"
    path = work / "serve-lora.yaml"
    path.write_text(yaml.safe_dump(config))
    url = [f"http://127.0.0.1:{port}"]
    with vllm_server(path, work / "lora.log", port, cores=cores):
        found = {
            "adapter": pushes(model, url, count, lora, adapter=True),
            "merged": pushes(model, url, count, lora, adapter=False),
        }
    print("\nLoRA r 16 on all linear layers, one server: the adapter alone against the merged weights")
    print("| push | MiB | gather s | write s | load s | total s |")
    print("|---|---|---|---|---|---|")
    for name, push in found.items():
        print(
            f"| {name} | {push['bytes'] / 2**20:,.1f} | {push['gather']:.3f} | {push['write']:.3f} | "
            f"{push['load']:.3f} | {push['total']:.3f} |"
        )
    ratio = found["merged"]["total"] / found["adapter"]["total"]
    print(
        f"adapter push {ratio:.1f}x faster, {found['merged']['bytes'] / found['adapter']['bytes']:.0f}x fewer bytes"
    )
    return found


def report(size: str, found: dict[str, Any], cores: list[int], halves: list[list[int]]) -> None:
    one, two = found["push_one"], found["push_two"]
    print(
        f"\n{size} ({one['params'] / 1e6:,.0f}M parameters, {one['bytes'] / 2**20:,.0f} MiB float32): weight push"
    )
    print("| servers | gather s | write s | load s | total s |")
    print("|---|---|---|---|---|")
    for name, push in (("1", one), ("2", two)):
        print(
            f"| {name} | {push['gather']:.2f} | {push['write']:.2f} | {push['load']:.2f} | {push['total']:.2f} |"
        )
    gen_one, gen_two = found["gen_one"], found["gen_two"]
    if not gen_one:
        return
    print(f"\n{size}: generation on cores {cores}")
    print("| layout | completions/s | tokens/s | ratio |")
    print("|---|---|---|---|")
    print(
        f"| 1 server on {len(cores)} cores | {gen_one['completions_per_s']:.1f} | {gen_one['tokens_per_s']:.0f} | 1.00 |"
    )
    ratio = gen_two["tokens_per_s"] / gen_one["tokens_per_s"]
    print(
        f"| 2 servers on {len(halves[0])} core(s) each | {gen_two['completions_per_s']:.1f} | "
        f"{gen_two['tokens_per_s']:.0f} | {ratio:.2f}x |"
    )


if __name__ == "__main__":
    main()
