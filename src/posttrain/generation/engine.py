"""``EngineCopy``: the base of every engine that generates from its own copy of the weights (vLLM colocated in
this process, a server or a pool of them; another engine the same way), pushed after each update. What
generation ahead of training and the harness's tasks during training need of an engine beyond the contract
(``generation.types.GenerationEngine``): :meth:`EngineCopy.sample` without the training module, and
:meth:`EngineCopy.alive`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.generation.types import Completions, Sampling


class EngineCopy(ABC):
    """A backend that generates from its own copy of the weights (an engine in this process, or a server):
    they are pushed before the first generation after an update (the rollout marks them stale)."""

    name = "engine"
    stale = True

    def generate(
        self,
        module: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool = False,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> Completions:
        """``keys`` None: greedy (evaluation). ``logprobs``: the sampled tokens' log-probabilities too.
        ``images``: each prompt's (a vision-language model's, whose prompts hold their expansion)."""
        if self.stale:
            self.push(module)
        if images and any(images):
            return self.sample_images(prompts, sampling, keys, logprobs, images)
        return self.sample(prompts, sampling, keys, logprobs)

    def sample_images(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool,
        images: Sequence[Sequence[Any]],
    ) -> Completions:
        raise ValueError(f"prompts with images reached {type(self).__name__}, which does not take them yet")

    @abstractmethod
    def push(self, module: torch.nn.Module) -> None:
        """The training weights given to the engine (a collective: every process calls it)."""

    @abstractmethod
    def sample(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, keys: list[int] | None, logprobs: bool
    ) -> Completions:
        """Completions from the engine's own weights, without the training module (generation ahead of
        training, the harness's tasks during training)."""

    def alive(self) -> bool:
        """Whether the engine can still answer (a server asked to stop may not: a wait on it gives up)."""
        return True

    @abstractmethod
    def close(self) -> None: ...

    def mark_stale(self) -> None:
        """An update changed the training weights: push them before the next generation."""
        self.stale = True
