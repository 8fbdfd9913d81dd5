"""Where each optimizer step's micro-batches come from (the loop's step feeds): the training loader's,
grouped by the step plan, by default; a method that makes or amends its batches while training (grpo's
rollouts, kto's KL baseline, dpo's step token count) brings its own through ``TrainerSpec.steps``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from posttrain.context import RunContext
from posttrain.training.extras import StepExtra

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from posttrain.plan import Batches
    from posttrain.training.engine import Engine
    from posttrain.training.loop import LoopState


class SideGeneration(Protocol):
    """An online run's engine for greedy generations beside the steps (the harness's tasks during training):
    every rank calls :meth:`prepare` (a collective: the engine given the current weights), then any rank
    may call :meth:`generate`."""

    def prepare(self, module: torch.nn.Module) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions of ``prompts`` (token ids), each up to ``max_new_tokens`` or a stop token."""
        ...


class StepFeed(Protocol):
    """Where each optimizer step's micro-batches come from: a data loader's, grouped by the step plan
    (:class:`LoaderSteps`), or a method's own (grpo generates them from the current weights). ``extras`` add
    the source's own terms and metrics to each step (the loop treats them as any step extra)."""

    extras: list[StepExtra]
    #: an online feed's engine with weights of its own, for generations beside the steps; None: the evaluators
    #: generate on the training model
    generation: SideGeneration | None

    def steps(self, state: LoopState) -> Iterator[list[dict[str, Any]]]:
        """The remaining steps of ``state.epoch`` from ``state.epoch_step`` on (resuming mid-epoch)."""
        ...


def group_steps(
    loader: Iterable[dict[str, Any]], sizes: list[int], skip_steps: int = 0
) -> Iterator[list[dict[str, Any]]]:
    """Micro-batches grouped into optimizer steps of ``sizes`` micro-batches each (see ``plan.step_plan``).
    The first ``skip_steps`` steps are passed over (resuming in the middle of an epoch)."""
    micro_batches = itertools.islice(iter(loader), sum(sizes[:skip_steps]), None)
    for size in sizes[skip_steps:]:
        group = list(itertools.islice(micro_batches, size))
        if not group:
            return
        yield group


def repeat_first(loader: Iterable[dict[str, Any]], sizes: list[int]) -> Iterator[list[dict[str, Any]]]:
    """``overfit_first_batch``: the first micro-batch as every micro-batch of every step."""
    first = next(iter(loader))
    for size in sizes:
        yield [first] * size


class LoaderSteps:
    """The data loader's micro-batches grouped into optimizer steps as the step plan says."""

    def __init__(
        self,
        loader: Iterable[dict[str, Any]],
        set_epoch: Callable[[int], None],
        step_plan: list[list[int]],
        overfit_first_batch: bool = False,
    ) -> None:
        self.loader, self.set_epoch, self.step_plan = loader, set_epoch, step_plan
        self.overfit_first_batch = overfit_first_batch
        self.extras: list[StepExtra] = []
        self.generation: SideGeneration | None = None

    def steps(self, state: LoopState) -> Iterator[list[dict[str, Any]]]:
        sizes = self.step_plan[state.epoch]
        if self.overfit_first_batch:
            self.set_epoch(0)  # the very same first batch in every epoch (and after a resume)
            return repeat_first(self.loader, sizes[state.epoch_step :])
        self.set_epoch(state.epoch)
        return group_steps(self.loader, sizes, state.epoch_step)


def loader_steps(
    ctx: RunContext, engine: Engine, batches: Batches, tokenizer: PreTrainedTokenizerBase
) -> LoaderSteps:
    """The default ``steps`` hook (``registry.StepsBuilder``): the run's training loader."""
    plan = batches.plan
    return LoaderSteps(
        batches.train, batches.sampler.set_epoch, plan.step_plan, ctx.config.overfit_first_batch
    )
