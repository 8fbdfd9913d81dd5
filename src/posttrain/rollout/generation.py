"""Sampling completions: the backends (``transformers``' ``generate`` on the training weights in place, or
vLLM colocated on the training GPUs) and the draw that makes them reproducible.

Reproducible draws: every completion has a key, ``(seed, epoch, batch, prompt position, completion index)``
mixed into 62 bits, and each decoding step draws its token by inverting the row's distribution
``softmax(logits / T)`` (after top-k / top-p set the excluded tokens to -inf) at one uniform number that is a
pure function of (key, step). So a completion's tokens depend on its key and the logits, not on the other rows
of the batch, the process count or any generator's state: there is nothing to save in a checkpoint, and a run
resumed after a kill, or run on two processes instead of one, draws the same tokens. (One uniform per row and
step costs what transformers' own multinomial draw costs; keyed noise for every token of the vocabulary, the
Gumbel-max way, took 1.9 s more per step at a 32K vocabulary on a 2-core CPU.) The logits themselves may differ in the last float bits with the batch's composition (2e-7
measured on CPU between a row generated alone and among others), which decides a draw only at an exact tie.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from posttrain.models.sampling_policy import SamplingPolicy, kept_tokens, penalty_scale

MASK = (1 << 62) - 1
_C1, _C2, _C3 = 0x3C79AC492BA7B653 & MASK, 0x1C69B3F74AC4AE35 & MASK, 0x2545F4914F6CDD1D & MASK


def _mix_int(x: int) -> int:
    x = (x ^ (x >> 29)) & MASK
    x = (x * _C1) & MASK
    x = (x ^ (x >> 32)) & MASK
    x = (x * _C2) & MASK
    return x ^ (x >> 29)


def completion_key(*parts: int) -> int:
    """A completion's 62-bit key from its coordinates (seed, epoch, batch, prompt position, index)."""
    key = 0x1F83D9ABFB41BD6B & MASK
    for part in parts:
        key = _mix_int(key ^ (int(part) & MASK))
    return key


def _mix(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix_int` on int64 tensors (products wrap; the low 62 bits are the same)."""
    x = (x ^ (x >> 29)) & MASK
    x = (x * _C1) & MASK
    x = (x ^ (x >> 32)) & MASK
    x = (x * _C2) & MASK
    return x ^ (x >> 29)


def keyed_uniform(keys: torch.Tensor, step: int) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row: a pure function of (key, step)."""
    bits = _mix(_mix(keys ^ ((step * _C3) & MASK)))
    return ((bits >> 9) & ((1 << 52) - 1)).double() / 2.0**52 + 2.0**-53


def keyed_draw(scores: torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor:
    """Each row's token drawn from ``softmax(scores)`` by inverting its distribution at the row's keyed
    uniform: ``[rows]`` token ids. Excluded tokens (-inf scores: top-k, top-p) have no probability."""
    probabilities = torch.softmax(scores.float(), dim=-1).double()
    cumulative = probabilities.cumsum(dim=-1)
    target = keyed_uniform(keys.to(scores.device), step) * cumulative[:, -1]
    drawn = torch.searchsorted(cumulative, target.unsqueeze(-1))
    return drawn.clamp(max=scores.shape[-1] - 1).squeeze(-1)


class KeyedSampler:
    """A logits processor for transformers' ``generate``: every row's token for this step is drawn with
    :func:`keyed_draw` and becomes the only one left, so greedy decoding over the processed scores samples
    (see the module docstring)."""

    def __init__(self, keys: torch.Tensor, prompt_length: int) -> None:
        self.keys, self.prompt_length = keys, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        drawn = keyed_draw(scores, self.keys, input_ids.shape[1] - self.prompt_length)
        out = torch.full_like(scores, -torch.inf)
        return out.scatter_(1, drawn.unsqueeze(-1), 0.0)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    banned: tuple[int, ...] = ()

    @property
    def policy(self) -> SamplingPolicy:
        """What the sampler does before it draws (``models/sampling_policy.py``: the trainer replays it)."""
        return SamplingPolicy(self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.banned)


class PolicyProcessor:
    """A logits processor for transformers' ``generate`` that applies the run's sampler
    (``sampling_policy``) as the trainer replays it: the repetition penalty over each row's own tokens (not
    its left padding), then, when sampling, the temperature and the kept set (-inf outside it); greedy, the
    banned tokens (-inf)."""

    def __init__(self, sampling: Sampling, padding: torch.Tensor, sampled: bool) -> None:
        self.policy, self.temperature, self.sampled = sampling.policy, sampling.temperature, sampled
        self.padding = padding  # [rows]: each row's left padding

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        policy = self.policy
        if policy.repetition_penalty != 1.0:
            width = input_ids.shape[1]
            own = torch.arange(width, device=scores.device) >= self.padding.to(scores.device).unsqueeze(1)
            counts = torch.zeros_like(scores).scatter_add_(1, input_ids, own.to(scores.dtype))
            scores = scores * penalty_scale(scores, counts > 0, policy.repetition_penalty)
        if not self.sampled:  # greedy: the banned tokens are out all the same
            if policy.banned:
                scores = scores.index_fill(-1, torch.tensor(policy.banned, device=scores.device), -torch.inf)
            return scores
        scores = scores / self.temperature
        if policy.truncates:
            scores = scores.masked_fill(~kept_tokens(scores, policy), -torch.inf)
        return scores


@dataclass
class Completions:
    """One sampled completion per prompt row: its token ids (the stop token included when it came), whether
    it ran into the length limit without one, and (from an engine that reports them) the sampling
    log-probability of each of its tokens."""

    ids: list[list[int]]
    truncated: list[bool]
    logps: list[list[float]] | None = None
    #: multi-turn rollouts (tools, environments, a ``rollout_func``): 1 for the model's tokens, 0 for what the
    #: tools and the chat template added between its turns (left out of the loss)
    tool_mask: list[list[int]] | None = None
    #: the prompts as the rollout rendered them (with the tools' schemas, an environment's observation)
    prompt_ids: list[list[int]] | None = None
    #: each completion as messages (assistant turns with their tool calls, tool results)
    messages: list[list[dict[str, Any]]] | None = None
    #: each rollout's environment instance (``environment_factory``), for the rewards
    environments: list[Any] | None = None
    #: columns a ``rollout_func`` returned besides the ids, for the rewards (one value per completion)
    columns: dict[str, list[Any]] | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    #: an agent's episodes (``agent_function``): each completion's engine calls as the engine saw and sampled
    #: them (prompt and completion ids, log-probabilities, branch), for the completions log
    calls: list[list[dict[str, Any]]] | None = None

    def model_lengths(self) -> list[int]:
        """Each completion's tokens the model wrote (tool results not counted), as TRL counts lengths."""
        if self.tool_mask is None:
            return [len(ids) for ids in self.ids]
        return [sum(mask) for mask in self.tool_mask]


def split_completions(sequences: torch.Tensor, stop_ids: Sequence[int], pad_id: int) -> Completions:
    """Generated rows (``[rows, new tokens]``) cut after their first stop token."""
    ids, truncated = [], []
    stops = set(stop_ids)
    for row in sequences.tolist():
        end = next((i for i, token in enumerate(row) if token in stops), None)
        ids.append(row if end is None else row[: end + 1])
        truncated.append(end is None)
    return Completions(ids, truncated)


def left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, longest - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def generation_eos(module: torch.nn.Module) -> set[int]:
    """The end-of-sequence ids of the model's own generation config (``generation_config.json``), which TRL
    stops at beside the tokenizer's EOS."""
    from posttrain.models.token_logps import unwrap

    found = getattr(getattr(unwrap(module), "generation_config", None), "eos_token_id", None)
    if found is None:
        return set()
    return {int(found)} if isinstance(found, int) else {int(i) for i in found}


@contextlib.contextmanager
def generating(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The training module set up to generate: eval mode, the KV cache on, ZeRO-3 parameters gathered once
    for the whole generation, and a blank generation config in place of the model's, so that none of its
    defaults (a ``repetition_penalty``, ``top_k``, ``suppress_tokens``... from ``generation_config.json``)
    fills what the run leaves unset: completions come from the policy being trained, sampled as the config
    says; everything restored after."""
    from transformers import GenerationConfig

    from posttrain.models.token_logps import unwrap

    base = unwrap(module)
    own = getattr(base, "generation_config", None)
    training, use_cache = module.training, getattr(base.config, "use_cache", True)
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    gathered: Any = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned)
    module.eval()
    base.config.use_cache = True
    base.generation_config = GenerationConfig()
    try:
        with gathered, torch.no_grad():
            yield module
    finally:
        base.generation_config = own
        base.config.use_cache = use_cache
        module.train(training)


class GenerationStopped(RuntimeError):
    """Generation gave up because the run is stopping (a signal came while it waited for a server that the
    stop took with it): the step it was for is not trained, and the run saves after its last whole step."""


class GenerationBackend(Protocol):
    """Where an online run's completions come from (the feed and the multi-turn rollouts depend on this
    alone): transformers' ``generate`` on the training weights (``TransformersBackend``), or an engine with
    its own copy of the weights (``vllm_engine.EngineCopy``: one in this process, or a server)."""

    name: str

    def generate(
        self,
        module: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool = False,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> Completions:
        """One completion per prompt (token ids), drawn from ``keys`` (None: greedy); ``logprobs``: the
        engine's log-probabilities of the sampled tokens too (None where the sampler is the trainer);
        ``images``: each prompt's images (Pillow, in the order of its image tokens: a vision-language model's
        prompts hold the processor's expanded ids)."""
        ...

    def mark_stale(self) -> None:
        """An update changed the training weights (a copy must be pushed before the next generation)."""
        ...

    def close(self) -> None: ...


class TransformersBackend:
    """``generate`` with the KV cache on the training weights in place (PEFT adapters included)."""

    name = "transformers"

    def __init__(self, stop_ids: Sequence[int], pad_id: int, processor: Any = None) -> None:
        """``processor``: a vision-language model's processor (its image processor makes the image inputs)."""
        self.stop_ids, self.pad_id, self.processor = list(stop_ids), pad_id, processor

    def generate(
        self,
        module: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool = False,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> Completions:
        """``keys`` None: greedy (evaluation). ``logprobs`` is for an engine apart from the trainer (vLLM): here
        the sampling and the training model are one, so there is no mismatch to report."""
        from transformers import GenerationConfig, LogitsProcessorList

        from posttrain.vision.collate import image_inputs

        device = next(module.parameters()).device
        ids, mask = left_padded(prompts, self.pad_id, device)
        pictures = image_inputs(self.processor, images) if images and self.processor is not None else {}
        if images and any(images) and self.processor is None:
            raise ValueError("prompts with images for a model without an image processor")
        if self.processor is not None and not pictures:
            from posttrain.vision.processor import image_token

            if bool((ids == image_token(self.processor)[1]).any()):
                raise ValueError("prompts hold image tokens, and their images were not given to generation")
        stops = sorted(set(self.stop_ids) | generation_eos(module))
        padding = torch.tensor([ids.shape[1] - len(p) for p in prompts], dtype=torch.long)
        processors = LogitsProcessorList([PolicyProcessor(sampling, padding, keys is not None)])
        if keys is not None:
            processors.append(KeyedSampler(torch.tensor(keys, dtype=torch.int64), ids.shape[1]))
        options = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=self.pad_id,
            num_beams=1,
        )
        with generating(module) as model:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=options,
                logits_processor=processors,
                **{key: value.to(device) for key, value in pictures.items()},
            )
        return split_completions(out[:, ids.shape[1] :].cpu(), stops, self.pad_id)

    def mark_stale(self) -> None:
        """Nothing to push: generation runs on the training weights."""

    def close(self) -> None:
        pass
