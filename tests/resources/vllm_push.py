"""Run by tests/integration/test_vllm_engine.py in a process of its own: a colocated vLLM engine over one tiny
model, then that model's weights replaced by another's and pushed; prints the greedy completions of long
prompts (engine and transformers, before and after) as one JSON line. ``--no-reset``: the push leaves the
prefix cache as it was; ``--cuda``: the engine and the model on the GPU."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from posttrain.config import load_config
from posttrain.rollout.generation import Sampling, TransformersBackend
from posttrain.rollout.vllm_engine import build_vllm_backend
from posttrain.tiny_model import write_tiny_model


def main(root: Path, reset: bool, device: str) -> None:
    first = write_tiny_model(root / "first", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    second = write_tiny_model(root / "second", seed=1, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    config = load_config(
        data={
            "type": "grpo",
            "model": {"name_or_path": str(first), "dtype": "float32"},
            "data": {"sources": [str(root / "unused.jsonl")]},
            "rewards": [{"type": "length_penalty"}],
            "use_vllm": True,
            "max_completion_length": 12,
        }
    )
    module = AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32).to(device)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(48)] for _ in range(4)]  # a 32-token block and more
    sampling, dist = Sampling(12), SimpleNamespace(rank=0, local_rank=0, world_size=1)
    backend = build_vllm_backend(config, module, [2], 48, len(prompts), dist)
    if not reset:
        backend.llm.reset_prefix_cache = lambda *args, **kwargs: True
    reference = TransformersBackend([2], 0)
    out = {
        "before": backend.generate(module, prompts, sampling, None).ids,
        "expected_before": reference.generate(module, prompts, sampling, None).ids,
    }
    other = AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32)
    module.load_state_dict(other.state_dict())
    backend.mark_stale()
    out["after"] = backend.generate(module, prompts, sampling, None).ids
    out["expected_after"] = reference.generate(module, prompts, sampling, None).ids
    backend.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--no-reset" not in sys.argv[2:], "cuda" if "--cuda" in sys.argv[2:] else "cpu")
