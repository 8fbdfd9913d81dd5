"""Which prompts a generated batch holds and this rank's completion slots of it (``rollout/feed.py``'s module
docstring): the epoch's prompt order, the refill orders of dynamic sampling, each slot's row, prompt ids and
key. Pure functions of the seeds, the epoch, the batch and the rank: the same for any process count or timing."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from posttrain.data.prompts import decode_row
from posttrain.data.sampler import shard_order
from posttrain.generation.keyed import completion_key

#: the refill orders' part of their key (dynamic sampling), apart from every completion's
REFILL = 0x5EF111


class PromptSlots:
    """A run's prompt order and this rank's slots. ``per_batch``: prompts per generated batch; ``group``:
    completions per prompt; ``mine``: this rank's completions of a batch; ``per_epoch``: generated batches per
    epoch."""

    def __init__(
        self,
        prompts: Any,
        seed: int,
        data_seed: int,
        *,
        group: int,
        per_batch: int,
        mine: int,
        rank: int,
        per_epoch: list[int],
    ) -> None:
        self.prompts, self.seed, self.data_seed = prompts, seed, data_seed
        self.group, self.per_batch, self.mine, self.rank = group, per_batch, mine, rank
        self.offsets = [sum(per_epoch[:e]) for e in range(len(per_epoch) + 1)]  # global batch index
        self.orders: dict[int, np.ndarray] = {}  # an epoch's prompt order
        self.orders_lock = threading.Lock()  # generation ahead reads them on its own thread
        self.refill_order: tuple[tuple[int, int], np.ndarray] = ((-1, -1), np.zeros(0, dtype=np.int64))

    @classmethod
    def of_run(cls, ctx: Any, plan: Any, group: int, updates: int) -> PromptSlots:
        """A run's (``plan``: its ``DataPlan``; ``updates``: optimizer steps per generated batch). This rank
        generates its replica's share of a batch, split over a sequence-parallel group."""
        config, sizes = ctx.config, plan.sizes
        mine = sizes.micro_batch_size * sizes.gradient_accumulation_steps // config.sequence_parallel_size
        return cls(
            plan.data.train,
            config.seed,
            config.data.seed,
            group=group,
            per_batch=sizes.global_batch_size // group,
            mine=mine,
            rank=ctx.dist.rank,
            per_epoch=[len(steps) // updates for steps in plan.step_plan],
        )

    def global_batch(self, epoch: int, batch: int) -> int:
        """A generated batch's index over the whole run."""
        return self.offsets[epoch] + batch

    def place(self, index: int) -> tuple[int, int, int]:
        """The epoch and batch of generated batch ``index`` of the run, and the epoch's batch count."""
        epoch = max(e for e in range(len(self.offsets) - 1) if self.offsets[e] <= index)
        return epoch, index - self.offsets[epoch], self.offsets[epoch + 1] - self.offsets[epoch]

    def take(
        self, epoch: int, batch: int, round_: int = 0
    ) -> tuple[int, range, list[dict[str, Any]], list[list[int]], list[int]]:
        """This rank's share of a batch: its first slot, its slots, each slot's row, prompt ids and key.
        ``round_`` > 0: a refill round of the batch (:meth:`refill_positions`), its prompts numbered on from
        the batch's (prompt ``round_ * P + p``), so each completion has a key of its own."""
        group = self.group
        first = self.rank * self.mine
        slots = range(first, first + self.mine)
        if round_:
            positions = self.refill_positions(epoch, batch, round_)
        else:
            positions = self.order(epoch)[batch * self.per_batch : (batch + 1) * self.per_batch]
        items = {s // group: self.prompts[int(positions[s // group])] for s in slots}
        rows = {p: decode_row(item) for p, item in items.items()}
        prompt_ids = [np.asarray(items[s // group]["input_ids"]).tolist() for s in slots]
        numbered = round_ * self.per_batch
        keys = [completion_key(self.seed, epoch, batch, numbered + s // group, s % group) for s in slots]
        return first, slots, [rows[s // group] for s in slots], prompt_ids, keys

    def refill_positions(self, epoch: int, batch: int, round_: int) -> np.ndarray:
        """The prompts of refill round ``round_`` (1, 2, ...) of a batch (dynamic sampling): the next P of the
        batch's refill order, a permutation of the epoch's other prompts drawn from (``data.seed``, epoch,
        batch) alone; so a refill never changes which prompts later batches get, and is the same for any
        process count or timing (wrapping round when the data has fewer prompts)."""
        key = (epoch, batch)
        if self.refill_order[0] != key:
            own = self.order(epoch)[batch * self.per_batch : (batch + 1) * self.per_batch]
            rest = np.setdiff1d(np.arange(len(self.prompts)), own)
            rest = rest if len(rest) else np.arange(len(self.prompts))
            draw = np.random.default_rng(completion_key(self.data_seed, epoch, batch, REFILL))
            self.refill_order = (key, rest[draw.permutation(len(rest))])
        order = self.refill_order[1]
        return order[(np.arange(self.per_batch) + (round_ - 1) * self.per_batch) % len(order)]

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's prompt order (the two latest kept: a batch generated ahead may be the next epoch's)."""
        with self.orders_lock:
            if epoch not in self.orders:
                self.orders[epoch] = shard_order(len(self.prompts), 1, 0, self.data_seed, epoch)
                for old in sorted(self.orders)[:-2]:
                    del self.orders[old]
            return self.orders[epoch]
