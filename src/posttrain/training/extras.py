"""What the loop lets other parts add to an optimizer step, so that it knows no model feature itself.

- A :class:`StepObserver` (the profilers) is told when each step starts and finishes.
- A :class:`StepExtra` (a mixture-of-experts model's router loss and expert load today; a z-loss or a
  multi-token head tomorrow) may watch each micro-batch's forward, add a term to its objective, and report
  values that the loop sums over the step's micro-batches and, in the step's one all-reduce, over the ranks,
  reading them back by name.
- An :class:`Evaluator` (lm-evaluation-harness tasks) measures the model beside the method's own evaluation,
  after the steps it names and at the end, its entries added to that step's record.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

#: a method's metric ``name`` comes with ``name + COUNT`` when it is a mean over something other than the loss
#: units (a token mean when the loss is per completion): the loop divides it by that sum, over the step's
#: micro-batches and every rank, instead
COUNT = ":count"


class StepObserver(Protocol):
    def step_started(self, step: int) -> None: ...

    def step_finished(self, step: int) -> None: ...

    def close(self) -> None: ...


class StepExtra(Protocol):
    def recording(self) -> AbstractContextManager[None]:
        """Entered around each training micro-batch's forward (the method's loss function)."""
        ...

    def micro_batch(
        self, batch: dict[str, Any], micro_batches: int
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """After a micro-batch's forward: the term added to its objective (None: nothing; the step has
        ``micro_batches`` of them) and device values (scalars) to sum over the step's micro-batches."""
        ...

    def step_values(self, sums: dict[str, float], micro_batches: int, report: bool) -> dict[str, list[float]]:
        """This rank's values for the step's all-reduce, named (names unique across extras, the same on every
        rank); ``sums`` holds what :meth:`micro_batch` returned, summed; ``report``: a metrics line is due."""
        ...

    def metrics(self, reduced: dict[str, list[float]], report: bool) -> dict[str, Any]:
        """The step record's entries, from the values summed over the ranks."""
        ...

    def describe(self) -> str:
        """One line for the start of the run: what the extra does."""
        ...

    def close(self) -> None: ...


class Evaluator(Protocol):
    def due(self, step: int, end: bool) -> bool:
        """Whether to evaluate after optimizer step ``step`` (``end``: the run's end, after its last step)."""
        ...

    def evaluate(self, module: torch.nn.Module, step: int) -> dict[str, Any]:
        """Called on every rank: the record's entries (rank 0's are the ones written)."""
        ...

    def describe(self) -> str: ...

    def close(self) -> None: ...
