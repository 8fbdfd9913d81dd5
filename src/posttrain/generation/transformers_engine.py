"""transformers' ``generate`` on the training weights in place (PEFT adapters included), sampling with the
keyed draw (``generation.keyed``) and the run's sampling policy as the trainer replays it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from posttrain.generation.keyed import KeyedSampler
from posttrain.generation.types import Completions, EngineInputs, Sampling
from posttrain.models.sampling_policy import kept_tokens, penalty_scale


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


class TransformersEngine:
    """``generate`` with the KV cache on the training weights in place (PEFT adapters included)."""

    name = "transformers"
    stale = False  # it generates on the training weights: never older than them

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

        from posttrain.models.token_logps import unwrap
        from posttrain.vision.collate import image_inputs, token_types

        device = next(module.parameters()).device
        ids, mask = left_padded(prompts, self.pad_id, device)
        pictures = image_inputs(self.processor, images) if images and self.processor is not None else {}
        if pictures:
            pictures |= token_types(unwrap(module), ids)
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

    def push(self, module: torch.nn.Module) -> None:
        """Nothing to push: generation runs on the training weights."""

    def mark_stale(self) -> None:
        """Nothing to push: generation runs on the training weights."""

    def close(self) -> None:
        pass


def transformers_engine(config: Any, inputs: EngineInputs) -> TransformersEngine:
    """``registry.GENERATION_ENGINES``' ``transformers`` (``use_vllm: false``): generation on the training
    weights in place."""
    return TransformersEngine(inputs.stops, inputs.pad_id, inputs.processor)
