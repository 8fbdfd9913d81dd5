"""Packing: several samples per sequence, each keeping its own positions and attending only to itself."""

from __future__ import annotations

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
