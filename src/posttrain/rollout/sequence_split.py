"""Sequence parallelism for an online method (``sequence_parallel_size`` > 1): generation on whole sequences,
the split after it.

Every process generates and scores its own share of the batch's completions, as a data-parallel process does
(the ``sequence_parallel_size`` processes of a group each take an equal part of the group's share, so the
rewards, the group statistics and the records are those of distinct completions). Before the training
micro-batches are made, the group's processes exchange their completions and per-completion values, so each
holds the group's share in slot order, the micro-batches one process of a run without sequence parallelism
would make; each micro-batch is then cut to this process's slice of the sequence
(``models.sequence_parallel.slice_rows``), the per-position values with it, and the old policy's, the
reference's and the policy's log-probabilities are computed on the slices by the group together (Ulysses
attention over the whole sequence). A loss that divides by a completion's length is given the whole
completion's (``completion_tokens``), so the slices' sums add up to the unsplit loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.generation.types import Completions
from posttrain.models.sequence_parallel import slice_rows

#: the per-position values of an online micro-batch, aligned with its shifted labels
TOKEN_KEYS = ("completion_mask", "sampling_logps")
#: each completion's tokens in the loss over its whole sequence (before the split)
COMPLETION_TOKENS = "completion_tokens"


@dataclass
class SequenceSplit:
    """This process's place in its sequence-parallel group: ``size`` processes, this one ``rank`` of them."""

    size: int
    rank: int
    group: Any  # the torch process group
    pad_id: int

    def gather(
        self, prompt_ids: list[list[int]], completions: Completions, values: dict[str, torch.Tensor]
    ) -> tuple[list[list[int]], Completions, dict[str, torch.Tensor]]:
        """The group's completions in slot order, with their prompts and per-completion values."""
        import torch.distributed as dist

        mine = (
            completions.prompt_ids or prompt_ids,
            completions.ids,
            completions.truncated,
            completions.logps,
            completions.tool_mask,
            {name: value.cpu() for name, value in values.items()},
        )
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        prompts = [p for part in parts for p in part[0]]
        joined = Completions(
            [ids for part in parts for ids in part[1]],
            [cut for part in parts for cut in part[2]],
            None if parts[0][3] is None else [lp for part in parts for lp in part[3]],
            None if parts[0][4] is None else [m for part in parts for m in part[4]],
        )
        gathered = {name: torch.cat([part[5][name] for part in parts]) for name in parts[0][5]}
        return prompts, joined, gathered

    def cut(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One micro-batch (every process of the group holds it whole) cut to this process's slice."""
        from posttrain.data.samples import target_rows

        whole = batch["completion_mask"].sum(-1)
        sliced = slice_rows(batch, self.pad_id, self.size, self.rank, 0, TOKEN_KEYS)
        sliced[COMPLETION_TOKENS] = whole
        sliced["target_rows"] = target_rows(sliced)
        return sliced


def sequence_split(config: Any, rank: int, pad_id: int) -> SequenceSplit | None:
    """The run's split (None without sequence parallelism); the group is the one the model transform set up."""
    size = config.sequence_parallel_size
    if size == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as groups

    return SequenceSplit(size, rank % size, groups.get_sequence_parallel_group(), pad_id)


def whole_sequence_sums(config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For a value summed over each completion (the sequence-level importance weight's log-ratio), the map from
    this process's slices' sums to the whole sequences' (the sum over the group); None without sequence
    parallelism, where a process holds whole sequences."""
    if config.sequence_parallel_size == 1:
        return None

    def whole(partial: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as groups

        total = partial.clone()
        dist.all_reduce(total, group=groups.get_sequence_parallel_group())
        return total

    return whole
