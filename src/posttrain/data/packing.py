"""Packing: several samples per sequence, each keeping its own positions and attending only to itself.

The packers work on lengths alone and return bins of item indices (``offsets``, ``members``: bin ``k`` holds
``members[offsets[k]:offsets[k + 1]]``, in the order the items went in), so packed sequences refer to the
stored samples instead of copying their tokens. The list helpers below build packed samples from in-memory
samples for tests and small tools.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from posttrain.data.samples import IGNORE_INDEX, Sample

Bins = tuple[np.ndarray, np.ndarray]


def _bins(bin_of: np.ndarray, visit_order: np.ndarray, count: int) -> Bins:
    """CSR of items per bin; items keep the order in which they were placed."""
    members = visit_order[np.argsort(bin_of[visit_order], kind="stable")]
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=count), out=offsets[1:])
    return offsets, members.astype(np.int64)


def _check(lengths: np.ndarray, capacity: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"every item must hold 1 to {capacity} tokens to be packed")
    return lengths


def sequential_bins(lengths: Sequence[int] | np.ndarray, capacity: int) -> Bins:
    """Fill bins in order: an item that does not fit starts the next bin."""
    lengths = _check(np.asarray(lengths), capacity)
    bin_of = np.empty(len(lengths), dtype=np.int64)
    current, used = -1, capacity
    for index, size in enumerate(lengths.tolist()):
        if used + size > capacity:
            current, used = current + 1, 0
        bin_of[index] = current
        used += size
    return _bins(bin_of, np.arange(len(lengths), dtype=np.int64), current + 1)


def best_fit_bins(lengths: Sequence[int] | np.ndarray, capacity: int) -> Bins:
    """Best-fit decreasing in O(n log n): longest item first, each into the bin with the least room that still
    fits it (the lowest-numbered such bin), a new bin when none does.

    Bins are grouped by free room; a bitset of the rooms that have a bin finds the smallest fitting room in a
    few big-integer operations, and a heap per room keeps the lowest bin number first."""
    lengths = _check(np.asarray(lengths), capacity)
    visit = np.argsort(-lengths, kind="stable")
    bin_of = np.empty(len(lengths), dtype=np.int64)
    rooms: dict[int, list[int]] = {}
    occupied = 0  # bit r set: some bin has exactly r free tokens
    count = 0
    sizes = lengths.tolist()
    for item in visit.tolist():
        size = sizes[item]
        fits = occupied >> size
        if fits:
            room = size + (fits & -fits).bit_length() - 1
            heap = rooms[room]
            target = heapq.heappop(heap)
            if not heap:
                occupied ^= 1 << room
        else:
            target, room = count, capacity
            count += 1
        left = room - size
        heap = rooms.setdefault(left, [])
        if not heap:
            occupied |= 1 << left
        heapq.heappush(heap, target)
        bin_of[item] = target
    return _bins(bin_of, visit, count)


PACKERS = {"sequential": sequential_bins, "best-fit": best_fit_bins}


def pack_bins(lengths: np.ndarray, capacity: int, method: str) -> Bins:
    return PACKERS[method](lengths, capacity)


def with_positions(sample: Sample) -> Sample:
    """Add ``position_ids`` (0..n-1) and mask the first label: no token before it in its own sample."""
    labels = list(sample["labels"])
    if labels:
        labels[0] = IGNORE_INDEX
    return {
        "input_ids": list(sample["input_ids"]),
        "labels": labels,
        "position_ids": list(range(len(sample["input_ids"]))),
    }


def join_samples(samples: Sequence[Sample]) -> Sample:
    """One row holding ``samples`` one after another, each with its own positions (``with_positions``)."""
    items = [with_positions(sample) for sample in samples]
    return {key: [x for item in items for x in item[key]] for key in ("input_ids", "labels", "position_ids")}


def _join(samples: list[Sample], bins: Bins) -> list[Sample]:
    offsets, members = bins
    return [
        join_samples([samples[i] for i in members[offsets[k] : offsets[k + 1]]])
        for k in range(len(offsets) - 1)
    ]


def pack_sequential(samples: list[Sample], max_length: int) -> list[Sample]:
    """Position ids restart at 0 for every sample; the model builds a block-diagonal causal mask from them,
    so no token attends across samples. Each sample's first label is ignored, so the last token of one
    sample is never trained to predict the first token of the next."""
    return _join(samples, sequential_bins([len(s["input_ids"]) for s in samples], max_length))


def pack_best_fit(samples: list[Sample], max_length: int) -> list[Sample]:
    """Same positions and label rules as :func:`pack_sequential`, bins chosen by :func:`best_fit_bins`."""
    return _join(samples, best_fit_bins([len(s["input_ids"]) for s in samples], max_length))


def pack(samples: list[Sample], max_length: int, method: str) -> list[Sample]:
    return _join(samples, pack_bins(np.array([len(s["input_ids"]) for s in samples]), max_length, method))


def packing_efficiency(sequences: Sequence[dict], max_length: int) -> float:
    """Share of the packed sequences' capacity (``max_length`` each) that holds tokens."""
    lengths = (
        sequences.lengths()
        if hasattr(sequences, "lengths")
        else np.array([len(s["input_ids"]) for s in sequences])
    )
    return float(lengths.sum() / (len(lengths) * max_length)) if len(lengths) else 0.0
