"""The policy an online method trains is the distribution its sampler draws from.

A sampler set with ``repetition_penalty``, ``top_k``, ``top_p`` or ``min_p`` does not draw from
``softmax(logits / T)``: it penalises the tokens already in the row, then keeps a set of tokens and renormalises
over it. vLLM's processed log-probabilities (``logprobs_mode: processed_logprobs``) are taken from that
distribution, so a trainer that scores the same tokens over the whole vocabulary sees every ratio
``exp(trainer - engine)`` shrunk by the kept probability mass (1e-34 at ``top_k: 5`` on the tiny model), and the
importance-sampling correction multiplies the gradient by it.

posttrain takes the truncated distribution as the policy, as TRL 1.17, NeMo RL and prime-rl do: the trainer
replays the sampler on its own logits, in vLLM's order (penalty, temperature, ``min_p``, ``top_k``, ``top_p``),
and every log-probability the loss sees (the policy's, the old policy's, the reference's) comes from the
replayed distribution. So on the same weights the trainer's and the engine's log-probabilities of a sampled
token agree, the ratio is 1, and the gradient is that of the distribution the completions came from (tokens
outside the kept set get none). The sampled token itself is always kept: a token the engine drew may sit
at the kept set's edge by a rounding difference, and dropping it would make its log-probability -inf.

:class:`SamplingPolicy` is the setting; :class:`Replay` applies it to a chunk of logits (``[rows, vocab]``)
of one batch, for the plain loss, the chunked head loss (``token_logps.ChunkedHeadNLL``) and transformers'
``generate`` alike, so the three cannot drift apart. Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: a position a token never took (``Replay``'s first occurrence of a token absent from the row)
NEVER = 2**31 - 1
#: logits whose kept set is found at once (the sort of ``top_p`` holds values and indices for each)
KEEP_CHUNK_ELEMENTS = 2**25


@dataclass(frozen=True)
class SamplingPolicy:
    """What the sampler does to ``logits / T`` before it draws: vLLM's and TRL's names and meanings
    (``top_k`` 0: off, ``top_p`` 1: off, ``min_p`` 0: off, ``repetition_penalty`` 1: off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    banned: tuple[int, ...] = ()
    """Tokens never drawn: a vision-language model's image token, which stands for an image's features in
    the input (a sampled one would have no image to stand for)."""

    @property
    def plain(self) -> bool:
        """Whether the sampler draws from ``softmax(logits / T)`` itself."""
        return not self.truncates and self.repetition_penalty == 1.0

    @property
    def truncates(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0 or bool(self.banned)


def policy_of(config: object, tokenizer: object = None) -> SamplingPolicy:
    """The sampling policy an online method's config sets (its ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``), with the tokens the model's processor reserves for its inputs never drawn."""
    from posttrain.vision.processor import input_only_tokens

    return SamplingPolicy(
        int(getattr(config, "top_k", 0) or 0),
        float(getattr(config, "top_p", 1.0)),
        float(getattr(config, "min_p", 0.0) or 0.0),
        float(getattr(config, "repetition_penalty", 1.0)),
        input_only_tokens(tokenizer) if tokenizer is not None else (),
    )


def penalty_scale(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """What the repetition penalty multiplies each logit by (vLLM's and transformers' rule: a positive logit
    of a token already ``seen`` in the row divided by the penalty, a negative one multiplied; 1 elsewhere)."""
    factor = torch.where(logits.detach() > 0, 1.0 / penalty, penalty).to(logits.dtype)
    return torch.where(seen, factor, torch.ones_like(factor))


def kept_tokens(logits: torch.Tensor, policy: SamplingPolicy) -> torch.Tensor:
    """Which tokens the sampler may draw, ``[rows, vocab]`` bool, from logits already penalised and divided by
    the temperature: ``min_p`` (probability at least ``min_p`` times the row's largest), then ``top_k`` (logits
    at least the k-th largest: ties kept), then ``top_p`` over what is left (the smallest set of the most
    likely tokens whose probability reaches ``top_p``; the most likely token always). vLLM's order and
    definitions (``vllm.v1.sample``: ``min_p`` as an argmax-invariant processor, then ``apply_top_k_top_p``).
    The ``banned`` tokens are out before all of them."""
    with torch.no_grad():
        z = logits.detach().float()
        keep = torch.ones_like(z, dtype=torch.bool)
        if policy.banned:
            banned = torch.tensor(policy.banned, device=z.device)
            keep.index_fill_(-1, banned, False)
            z = z.index_fill(-1, banned, -torch.inf)
        if policy.min_p > 0.0:
            probs = torch.softmax(z, dim=-1)
            keep &= probs >= policy.min_p * probs.amax(dim=-1, keepdim=True)
            z = z.masked_fill(~keep, -torch.inf)
        if policy.top_k and policy.top_k < z.shape[-1]:
            kth = torch.topk(z, policy.top_k, dim=-1).values[:, -1:]
            keep &= z >= kth
            z = z.masked_fill(~keep, -torch.inf)
        if policy.top_p < 1.0:
            ascending, order = torch.sort(z, dim=-1)
            below = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1.0 - policy.top_p
            below[:, -1] = False
            keep &= ~torch.zeros_like(below).scatter_(1, order, below)
        return keep


class Replay:
    """The sampler replayed on one batch's logits (see the module docstring). ``input_ids`` ``[rows, width]``:
    the batch's rows (the repetition penalty's history: every token at or before the predicting position);
    ``targets`` ``[rows, width]``: the sampled token each position predicts (-100: none), always kept."""

    def __init__(
        self,
        policy: SamplingPolicy,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        self.policy, self.width = policy, input_ids.shape[-1]
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.targets = targets.reshape(-1)
        self.first_seen: torch.Tensor | None = None

    def _first_seen(self, vocab: int, device: torch.device) -> torch.Tensor:
        """Per row, the first position of every token (:data:`NEVER` for one absent), ``[rows, vocab]``."""
        if self.first_seen is None or self.first_seen.shape[-1] != vocab:
            ids = self.input_ids.to(device)
            rows, width = ids.shape
            positions = torch.arange(width, device=device, dtype=torch.int64).expand(rows, width)
            if self.attention_mask is not None:
                positions = positions.masked_fill(self.attention_mask.to(device) == 0, NEVER)
            first = torch.full((rows, vocab), NEVER, dtype=torch.int64, device=device)
            self.first_seen = first.scatter_reduce_(1, ids.clamp(0, vocab - 1), positions, "amin")
        return self.first_seen

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logits`` ``[n, vocab]`` (float32, divided by the temperature) of the flat positions ``index``
        (over ``[rows x width]``): the sampler's logits (-inf outside the kept set) and, under a repetition
        penalty, the factor each logit was multiplied by (for a backward that recomputes the chain rule
        itself), else None."""
        policy, scale = self.policy, None
        if policy.repetition_penalty != 1.0:
            seen = self._first_seen(logits.shape[-1], logits.device)[index // self.width] <= (
                index % self.width
            ).unsqueeze(1)
            scale = penalty_scale(logits, seen, policy.repetition_penalty)
            logits = logits * scale
        if policy.truncates:
            keep = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
            step = max(1, KEEP_CHUNK_ELEMENTS // max(logits.shape[-1], 1))
            for start in range(0, logits.shape[0], step):  # a chunk of rows at a time: bounded sort memory
                keep[start : start + step] = kept_tokens(logits[start : start + step], policy)
            targets = self.targets.to(logits.device)[index]
            labelled = targets >= 0
            rows = torch.arange(index.shape[0], device=logits.device)
            keep[rows, targets.clamp(min=0)] |= labelled  # the sampled token is in, whatever the rounding
            logits = logits.masked_fill(~keep, -torch.inf)
        return logits, scale


def replay_for(
    policy: SamplingPolicy | None, batch: dict[str, torch.Tensor], targets: torch.Tensor
) -> Replay | None:
    """The batch's :class:`Replay`, or None when the sampler draws from the plain distribution."""
    if policy is None or policy.plain:
        return None
    return Replay(policy, batch["input_ids"], targets, batch.get("attention_mask"))


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - sum softmax(z) z`` per row of ``[rows, vocab]`` logits that may hold -inf (tokens
    outside a kept set: no probability, no share of the entropy)."""
    lse = torch.logsumexp(logits, dim=-1)
    shares = torch.exp(logits - lse.unsqueeze(-1))
    return lse - torch.where(shares > 0, shares * logits, torch.zeros_like(logits)).sum(-1)
