"""What generation hands out and what it takes, and the engine contract: the types the feed, the rewards
and the methods use without importing an engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from posttrain.models.sampling_policy import SamplingPolicy


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


class GenerationStopped(RuntimeError):
    """Generation gave up because the run is stopping (a signal came while it waited for a server that the
    stop took with it): the step it was for is not trained, and the run saves after its last whole step."""


@dataclass
class EngineInputs:
    """What an engine factory (``registry.GENERATION_ENGINES``) is given besides the run's config."""

    module: torch.nn.Module  # the training module (transformers generates on it; an engine copies it)
    stops: list[int]  # the ids a completion ends at
    pad_id: int
    data: Any  # the run's prompts (``plan.DataPlan``: its train and eval views)
    rows: int  # completions this process generates at once
    dist: Any  # this process's place (``dist.DistInfo``)
    stopping: Callable[[], bool]  # the run was asked to stop (a wait for a server gives up)
    processor: Any = None  # a vision-language model's processor

    def longest_prompt(self) -> int:
        """The longest prompt in tokens, training and evaluation prompts alike (an engine's context)."""
        views = (self.data.train, self.data.eval)
        return max((int(view.lengths("input_ids").max()) for view in views if len(view)), default=1)

    def most_images(self) -> int:
        """The most images one prompt holds, training and evaluation prompts alike (0: none, a text
        model's); read only by an engine that asks (it looks at every prompt's images)."""
        import numpy as np

        from posttrain.vision.images import IMAGES_COLUMN, decode

        most = 0
        for view in (self.data.train, self.data.eval):
            if len(view) and IMAGES_COLUMN in view.store.columns:
                stored = (view.store.get(IMAGES_COLUMN, int(i)) for i in np.unique(view.samples))
                most = max([most, *(len(decode(refs)) for refs in stored)])
        return most


class GenerationEngine(Protocol):
    """Where an online run's completions come from (the feed and the multi-turn rollouts depend on this
    alone): transformers' ``generate`` on the training weights (``TransformersEngine``), or an engine with
    its own copy of the weights (``engine.EngineCopy``: vLLM in this process, or a server). The registry
    ``GENERATION_ENGINES`` names them (``generation_engine``); a new engine is a module with its factory and
    one entry there."""

    name: str
    #: the engine's weights are older than the training weights: :meth:`push` them before it generates
    #: (always False where generation runs on the training weights)
    stale: bool

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

    def push(self, module: torch.nn.Module) -> None:
        """The training weights given to the engine (TRL's weight sync; nothing where generation runs on the
        training weights): a collective, every process calls it."""
        ...

    def mark_stale(self) -> None:
        """An update changed the training weights (a copy must be pushed before the next generation)."""
        ...

    def close(self) -> None: ...
