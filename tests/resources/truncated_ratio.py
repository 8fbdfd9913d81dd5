"""Run by tests/integration/test_truncated_sampling_vllm.py in a process of its own: a colocated vLLM engine over
a tiny float32 model samples with each truncating setting (``top_k``, ``top_p``, ``min_p``, a repetition
penalty, all of them); for every sampled token the engine's log-probability is compared with the trainer's
(``token_logps`` under the run's sampling policy), with the whole vocabulary's (the defect: the kept mass), and
with the value computed by hand from the model's logits. Then a real update (AdamW on a policy-gradient loss of
those tokens), the weights pushed, and the same again. Prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from posttrain.config import load_config
from posttrain.generation.types import Sampling
from posttrain.generation.vllm_engine import build_vllm_backend
from posttrain.models.sampling_policy import SamplingPolicy
from posttrain.models.token_logps import token_logps
from posttrain.rollout.feed import training_micro_batches
from posttrain.tiny_model import write_tiny_model

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.unit.test_sampling_policy import by_hand  # the hand computation, one home

TEMPERATURE = 0.8
SETTINGS = {
    "top_k": SamplingPolicy(top_k=5),
    "top_p": SamplingPolicy(top_p=0.5),
    "min_p": SamplingPolicy(min_p=0.4),
    "repetition_penalty": SamplingPolicy(repetition_penalty=1.5),
    "all": SamplingPolicy(top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.2),
}


def compare(module: torch.nn.Module, backend: object, policy: SamplingPolicy, seed: int) -> dict[str, float]:
    """Sample 8 completions of 4 prompts from the engine; the largest gap between the engine's and the
    trainer's log-probabilities, the ratio's mean, the full vocabulary's ratio mean, the largest gap to the
    hand computation."""
    prompts = [[5 + i, 40 + i, 7, 7, 90 + i, 7] for i in range(4)] * 2
    sampling = Sampling(12, TEMPERATURE, policy.top_p, policy.top_k, policy.repetition_penalty, policy.min_p)
    keys = [seed * 100 + i for i in range(len(prompts))]
    completions = backend.generate(module, prompts, sampling, keys, logprobs=True)  # type: ignore[attr-defined]
    (batch,) = training_micro_batches(prompts, completions, {}, len(prompts), 0, False)
    with torch.no_grad():
        trainer = token_logps(module, batch, False, TEMPERATURE, policy=policy)[0]
        plain = token_logps(module, batch, False, TEMPERATURE)[0]
        logits = module(input_ids=batch["input_ids"]).logits
    mask = batch["completion_mask"].bool()
    engine = batch["sampling_logps"]
    hand = torch.zeros_like(trainer)
    ids = batch["input_ids"]
    for row, position in mask.nonzero().tolist():
        token = int(ids[row, position + 1])
        history = {int(t) for t in ids[row, : position + 1]}
        hand[row, position] = by_hand(logits[row, position].tolist(), history, token, policy, TEMPERATURE)
    return {
        "tokens": int(mask.sum()),
        "gap": float((trainer - engine)[mask].abs().max()),
        "ratio_mean": float(torch.exp(trainer - engine)[mask].mean()),
        "full_vocabulary_ratio_mean": float(torch.exp(plain - engine)[mask].mean()),
        "hand_gap": float((trainer - hand)[mask].abs().max()),
    }


def update(module: torch.nn.Module, policy: SamplingPolicy, backend: object) -> None:
    """One AdamW step on a policy-gradient loss of freshly sampled tokens under the policy, then a push."""
    prompts = [[11, 12, 13, 12], [21, 22, 21, 23]]
    sampling = Sampling(12, TEMPERATURE, policy.top_p, policy.top_k, policy.repetition_penalty, policy.min_p)
    completions = backend.generate(module, prompts, sampling, [7, 8])  # type: ignore[attr-defined]
    (batch,) = training_micro_batches(prompts, completions, {}, 2, 0, False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=2e-3)
    logps = token_logps(module, batch, False, TEMPERATURE, policy=policy)[0]
    advantage = torch.tensor([[1.0], [-1.0]])
    (-(logps * batch["completion_mask"] * advantage).sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    backend.mark_stale()  # type: ignore[attr-defined]


def main(root: Path) -> None:
    model = write_tiny_model(root / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    config = load_config(
        data={
            "type": "grpo",
            "model": {"name_or_path": str(model), "dtype": "float32"},
            "data": {"sources": [str(root / "unused.jsonl")]},
            "rewards": [{"type": "length_penalty"}],
            "use_vllm": True,
            "max_completion_length": 12,
        }
    )
    module = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():  # peaked distributions, as a trained model's: the kept sets are small
        module.model.norm.weight.mul_(8.0)
    dist = SimpleNamespace(rank=0, local_rank=0, world_size=1)
    backend = build_vllm_backend(config, module, [2], 8, 8, dist)
    backend.mark_stale()  # the scaled norm: pushed before the first generation
    out: dict[str, dict[str, float]] = {}
    for index, (name, policy) in enumerate(SETTINGS.items()):
        out[name] = compare(module, backend, policy, index)
        update(module, policy, backend)
        out[name + " after an update"] = compare(module, backend, policy, index + 50)
    backend.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
