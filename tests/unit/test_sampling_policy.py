"""The policy under truncation (``models/sampling_policy.py``): the trainer's log-probabilities of sampled tokens
are those of the distribution the sampler draws from, computed here by hand, token by token, with plain
Python over the probabilities; the tiled head gives the plain path's values and gradients; transformers'
``generate`` draws only from the kept set."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.data.samples import IGNORE_INDEX
from posttrain.models.sampling_policy import SamplingPolicy
from posttrain.models.token_logps import token_logps

SETTINGS = {
    "top_k": SamplingPolicy(top_k=5),
    "top_p": SamplingPolicy(top_p=0.5),
    "min_p": SamplingPolicy(min_p=0.3),
    "penalty": SamplingPolicy(repetition_penalty=1.7),
    "all": SamplingPolicy(top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
    "banned": SamplingPolicy(banned=(7, 30, 41)),  # a vision-language model's image token
    "banned_top_p": SamplingPolicy(top_p=0.5, min_p=0.1, banned=(7, 30, 41)),
}
TEMPERATURE = 0.7


def kept_by_hand(
    logits: list[float], history: set[int], policy: SamplingPolicy, temperature: float = TEMPERATURE
) -> tuple[list[float], set[int]]:
    """One position's sampler in plain Python: the penalised logits over the temperature, and the tokens kept
    by min_p, top_k, then top_p over the tokens left (the most likely first until their mass reaches it)."""
    z = list(logits)
    for t in history:
        if policy.repetition_penalty != 1.0:
            z[t] = z[t] / policy.repetition_penalty if z[t] > 0 else z[t] * policy.repetition_penalty
    z = [v / temperature for v in z]
    kept = set(range(len(z))) - set(policy.banned)
    if policy.min_p:
        top = max(z[t] for t in kept)
        kept = {t for t in kept if math.exp(z[t] - top) >= policy.min_p}
    if policy.top_k:
        kth = sorted((z[t] for t in kept), reverse=True)[: policy.top_k][-1]
        kept = {t for t in kept if z[t] >= kth}
    if policy.top_p < 1.0:
        order = sorted(kept, key=lambda t: z[t], reverse=True)
        mass = sum(math.exp(z[t]) for t in order)
        chosen, held = set(), 0.0
        for t in order:
            chosen.add(t)
            held += math.exp(z[t]) / mass
            if held >= policy.top_p:
                break
        kept = chosen
    return z, kept


def by_hand(
    logits: list[float],
    history: set[int],
    token: int,
    policy: SamplingPolicy,
    temperature: float = TEMPERATURE,
) -> float:
    """log p(token) under the sampler, renormalised over the kept set (the sampled token always in it)."""
    z, kept = kept_by_hand(logits, history, policy, temperature)
    kept.add(token)
    return z[token] - math.log(sum(math.exp(z[t]) for t in kept))


@pytest.fixture(scope="module")
def setting() -> dict[str, object]:
    from posttrain.tiny_model import build_model

    model = build_model(256, hidden_size=32, heads=2, seed=3).double()
    with torch.no_grad():  # peaked next-token distributions, as a trained model's (a random one's are flat)
        model.model.norm.weight.mul_(25.0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 60, (3, 18), generator=generator)  # a small range: tokens repeat in a row
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX  # the prompt
    ids[2, 15:] = 0  # padding at the end of the last row
    labels[2, 15:] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0
    return {"model": model, "batch": {"input_ids": ids, "labels": labels, "attention_mask": mask}}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_trainer_scores_the_sampled_tokens_under_the_samplers_distribution(
    setting: dict[str, object], name: str
) -> None:
    policy, model, batch = SETTINGS[name], setting["model"], setting["batch"]
    assert isinstance(batch, dict) and isinstance(model, torch.nn.Module)
    logps = token_logps(model, batch, False, TEMPERATURE, policy=policy)[0].detach()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    ids, labels = batch["input_ids"], batch["labels"]
    checked = 0
    for row in range(ids.shape[0]):
        for position in range(ids.shape[1] - 1):
            token = int(labels[row, position + 1])
            if token == IGNORE_INDEX:
                continue
            history = {int(t) for t in ids[row, : position + 1]}
            expected = by_hand(logits[row, position].tolist(), history, token, policy)
            assert float(logps[row, position]) == pytest.approx(expected, rel=1e-6, abs=1e-6), (
                row,
                position,
            )  # float32
            checked += 1
    assert checked == 12 + 12 + 9  # the labels after the prompt; the last row padded after 9
    plain = token_logps(model, batch, False, TEMPERATURE)[0].detach()
    labelled = labels[:, 1:] != IGNORE_INDEX
    if policy.truncates and policy.repetition_penalty == 1.0:  # renormalised: more likely than under all
        assert (logps[:, :-1][labelled] >= plain[:, :-1][labelled] - 1e-12).all()
        assert (logps[:, :-1][labelled] > plain[:, :-1][labelled] + 1e-3).any()


@pytest.mark.parametrize("name", ["all", "penalty", "banned_top_p"])
def test_the_tiled_head_gives_the_plain_values_and_gradients(setting: dict[str, object], name: str) -> None:
    policy, model, batch = SETTINGS[name], setting["model"], setting["batch"]
    assert isinstance(batch, dict) and isinstance(model, torch.nn.Module)
    results = []
    for tiled in (False, True):
        model.zero_grad()
        logps, entropy = token_logps(model, batch, tiled, TEMPERATURE, entropy=True, policy=policy)
        weights = torch.linspace(0.5, 1.5, logps.numel(), dtype=logps.dtype).view(logps.shape)
        (logps * weights).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach(), entropy, grads))
    (plain, plain_entropy, plain_grads), (tiled, tiled_entropy, tiled_grads) = results
    labelled = torch.zeros_like(batch["labels"], dtype=torch.bool)
    labelled[:, :-1] = batch["labels"][:, 1:] != IGNORE_INDEX
    assert torch.allclose(plain[labelled], tiled[labelled].to(plain.dtype), atol=1e-9)
    assert torch.isfinite(tiled_entropy).all() and torch.allclose(
        plain_entropy[labelled], tiled_entropy[labelled].to(plain_entropy.dtype), atol=2e-5
    )  # the tiled entropy is summed over the vocabulary in float32 (the plain one here in float64)
    assert plain_grads.keys() == tiled_grads.keys()
    for name_, grad in plain_grads.items():
        scale = float(grad.abs().max())  # the plain path's logits are float32
        assert torch.allclose(grad, tiled_grads[name_].to(grad.dtype), rtol=1e-5, atol=1e-6 * scale), name_


def test_transformers_generate_draws_only_from_the_kept_set(setting: dict[str, object]) -> None:
    """transformers' backend samples with the same processor: every sampled token's log-probability under the
    replayed policy is finite and its probability under the sampler is what the trainer computes."""
    from posttrain.generation.transformers_engine import TransformersEngine
    from posttrain.generation.types import Sampling

    model = setting["model"]
    assert isinstance(model, torch.nn.Module)
    sampling = Sampling(8, TEMPERATURE, top_p=0.6, top_k=4, repetition_penalty=1.4, min_p=0.05)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    backend = TransformersEngine(stop_ids=[1], pad_id=0)
    out = backend.generate(model.float(), prompts, sampling, keys=[11, 12, 13])
    model.double()
    for prompt, completion in zip(prompts, out.ids, strict=True):
        ids = torch.tensor([prompt + completion])
        labels = torch.tensor([[IGNORE_INDEX] * len(prompt) + completion])
        batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
        logps = token_logps(model, batch, False, TEMPERATURE, policy=sampling.policy)[0].detach()
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        for step, token in enumerate(completion):
            position = len(prompt) - 1 + step
            history = set(prompt + completion[:step])
            expected = by_hand(logits[position].tolist(), history, token, sampling.policy)
            assert float(logps[0, position]) == pytest.approx(expected, rel=1e-6, abs=1e-6)
            # drawn from the kept set: it is there without being forced in
            assert token in kept_by_hand(logits[position].tolist(), history, sampling.policy)[1], (
                prompt,
                step,
            )


def test_banned_tokens_are_never_drawn_greedy_or_sampled(setting: dict[str, object]) -> None:
    """A vision-language model's image token is never generated (it would stand for an image that is not
    there): the greedy choice moves to the next token, sampling never draws it."""
    from posttrain.generation.transformers_engine import TransformersEngine
    from posttrain.generation.types import Sampling

    model = setting["model"]
    assert isinstance(model, torch.nn.Module)
    model.float()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    backend = TransformersEngine(stop_ids=[1], pad_id=0)
    greedy = backend.generate(model, prompts, Sampling(6), keys=None).ids
    banned = tuple(sorted({row[0] for row in greedy} | {row[1] for row in greedy}))
    moved = backend.generate(model, prompts, Sampling(6, banned=banned), keys=None).ids
    assert all(row[0] != first[0] for row, first in zip(moved, greedy, strict=True))
    sampled = backend.generate(model, prompts, Sampling(12, 1.5, banned=banned), keys=[1, 2, 3]).ids
    drawn = {token for row in moved + sampled for token in row}
    assert drawn and not drawn & set(banned)
    model.double()
