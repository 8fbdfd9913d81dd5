"""Run by tests/integration/test_vllm_engine.py in a process of its own: a colocated vLLM engine over one tiny
model, then that model's weights replaced by another's and pushed; prints the greedy completions of long
prompts (engine and transformers, before and after) as one JSON line. ``--no-reset``: the push leaves the
prefix cache as it was; ``--cuda``: the engine and the model on the GPU; ``--tied``: models whose LM head is
their input embedding."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from posttrain.config import load_config
from posttrain.generation.transformers_engine import TransformersEngine
from posttrain.generation.types import Sampling
from posttrain.generation.vllm_engine import build_vllm_backend
from posttrain.tiny_model import write_tiny_model


def token_logps(module: torch.nn.Module, prompt: list[int], ids: list[int]) -> list[float]:
    """The model's log-probability of each of ``ids`` after ``prompt``."""
    with torch.no_grad():
        tokens = torch.tensor([prompt + ids], device=next(module.parameters()).device)
        logps = module(tokens).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return logps.gather(-1, tokens[0, len(prompt) :, None])[:, 0].tolist()


def main(root: Path, reset: bool, device: str, tied: bool) -> None:
    shape = {"hidden_size": 64, "layers": 2, "vocab_size": 1024, "heads": 2, "tied": tied}
    first = write_tiny_model(root / "first", seed=0, **shape)
    second = write_tiny_model(root / "second", seed=1, **shape)
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
    reference = TransformersEngine([2], 0)
    out = {
        "before": backend.generate(module, prompts, sampling, None).ids,
        "expected_before": reference.generate(module, prompts, sampling, None).ids,
    }
    other = AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32)
    module.load_state_dict(other.state_dict())
    backend.mark_stale()
    out["after"] = backend.generate(module, prompts, sampling, None).ids
    out["expected_after"] = reference.generate(module, prompts, sampling, None).ids
    # sampled at temperature 1: the engine's log-probability of each token against the trained weights'
    sampled = backend.generate(module, prompts, sampling, keys=list(range(len(prompts))), logprobs=True)
    out["logp_gap"] = max(
        abs(a - b)
        for prompt, ids, logps in zip(prompts, sampled.ids, sampled.logps, strict=True)
        for a, b in zip(logps, token_logps(module, prompt, ids), strict=True)
    )
    backend.close()
    print(json.dumps(out))


if __name__ == "__main__":
    flags = sys.argv[2:]
    main(
        Path(sys.argv[1]),
        "--no-reset" not in flags,
        "cuda" if "--cuda" in flags else "cpu",
        "--tied" in flags,
    )
