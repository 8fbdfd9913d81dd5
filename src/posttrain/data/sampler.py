"""The training sampler: ``DistributedSampler``'s order (seeded per epoch, padded by wrapping around,
strided over ranks) held as one int64 tensor instead of Python lists, so it costs 8 bytes per sample."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler


def shard_order(count: int, world: int, rank: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """This rank's item numbers for ``epoch``, exactly as ``DistributedSampler(drop_last=False)`` gives them."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(count, generator=generator).numpy()
    else:
        order = np.arange(count, dtype=np.int64)
    per_rank = -(-count // world)
    return np.resize(order, per_rank * world)[rank::world] if count else order


class ShardSampler(Sampler[int]):
    def __init__(self, count: int, world: int, rank: int, seed: int, shuffle: bool = True) -> None:
        self.count, self.world, self.rank, self.seed, self.shuffle = count, world, rank, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.count // self.world)

    def __iter__(self) -> Iterator[int]:
        order = shard_order(self.count, self.world, self.rank, self.seed, self.epoch, self.shuffle)
        for start in range(0, len(order), 4096):
            yield from order[start : start + 4096].tolist()
