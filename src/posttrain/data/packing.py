"""Packing: several samples per sequence, each keeping its own positions and attending only to itself."""

from __future__ import annotations

import bisect

from posttrain.data.sft import IGNORE_INDEX

Sample = dict[str, list[int]]


def with_positions(sample: Sample) -> Sample:
    """Add ``position_ids`` (0..n-1) and mask the first label: no token before it in its own sample."""
    labels = list(sample["labels"])
    if labels:
        labels[0] = IGNORE_INDEX
    return {
        "input_ids": sample["input_ids"],
        "labels": labels,
        "position_ids": list(range(len(sample["input_ids"]))),
    }


def pack_sequential(samples: list[Sample], max_length: int) -> list[Sample]:
    """Fill sequences in order: a sample that does not fit starts the next sequence.

    Position ids restart at 0 for every sample; the model builds a block-diagonal causal mask from them,
    so no token attends across samples. Each sample's first label is ignored, so the last token of one
    sample is never trained to predict the first token of the next.
    """
    packed: list[Sample] = []
    current: Sample = {"input_ids": [], "labels": [], "position_ids": []}
    for sample in samples:
        item = with_positions(sample)
        if current["input_ids"] and len(current["input_ids"]) + len(item["input_ids"]) > max_length:
            packed.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        for key in current:
            current[key].extend(item[key])
    if current["input_ids"]:
        packed.append(current)
    return packed


def pack_best_fit(samples: list[Sample], max_length: int) -> list[Sample]:
    """Best-fit decreasing: longest sample first, each into the sequence with the least room that still
    fits it (a new sequence when none does). Same positions and label rules as :func:`pack_sequential`;
    sequences are usually filled to within a few tokens of ``max_length``."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["input_ids"]))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, bin index), sorted
    for index in order:
        size = len(samples[index]["input_ids"])
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            bins.append([index])
            bisect.insort(room, (max_length - size, len(bins) - 1))
            continue
        free, slot = room.pop(at)
        bins[slot].append(index)
        bisect.insort(room, (free - size, slot))
    packed = []
    for members in bins:
        items = [with_positions(samples[i]) for i in members]
        packed.append(
            {key: [x for item in items for x in item[key]] for key in ("input_ids", "labels", "position_ids")}
        )
    return packed


PACKERS = {"sequential": pack_sequential, "best-fit": pack_best_fit}


def pack(samples: list[Sample], max_length: int, method: str) -> list[Sample]:
    return PACKERS[method](samples, max_length)


def packing_efficiency(sequences: list[Sample], max_length: int) -> float:
    """Share of the packed sequences' capacity (``max_length`` each) that holds tokens."""
    if not sequences:
        return 0.0
    return sum(len(s["input_ids"]) for s in sequences) / (len(sequences) * max_length)
