"""Splits and mixes drawn on row and sample numbers (numpy arrays), never on the rows themselves."""

from __future__ import annotations

from typing import Any

import numpy as np


def held_out_mask(count: int, held_out: float, seed: int) -> np.ndarray:
    """A seeded random ``held_out`` share of ``count`` rows (at least one when the share is positive)."""
    mask = np.zeros(count, dtype=bool)
    if held_out <= 0 or count == 0:
        return mask
    chosen = np.random.default_rng(seed).permutation(count)[: max(1, round(count * held_out))]
    mask[chosen] = True
    return mask


def split_rows(rows: list[Any], held_out: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, eval) lists, both in their original order (see :func:`held_out_mask`)."""
    mask = held_out_mask(len(rows), held_out, seed)
    return [r for r, h in zip(rows, mask, strict=True) if not h], [
        r for r, h in zip(rows, mask, strict=True) if h
    ]


def weighted_picks(sizes: list[int], weights: list[float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """SiloGen's precomputed weighted mix, as ``(part, item)`` arrays: draw a part with probability
    proportional to its weight and take its next item (cycling), until every part with a positive weight
    has been used up at least once. Weight 0 drops a part. Draws are made in vectorised blocks."""
    active = np.array([i for i, (n, w) in enumerate(zip(sizes, weights, strict=True)) if w > 0 and n > 0])
    if len(active) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    probability = np.array([weights[i] for i in active], dtype=np.float64)
    probability /= probability.sum()
    need = np.array([sizes[i] for i in active], dtype=np.int64)
    rng = np.random.default_rng(seed)
    taken = np.zeros(len(active), dtype=np.int64)
    blocks = []
    while True:
        block = rng.choice(len(active), size=max(4096, int(need.sum())), p=probability)
        counts = np.bincount(block, minlength=len(active))
        missing = need - taken
        if np.any((missing > 0) & (counts < missing)):
            blocks.append(block)  # some part is not used up yet: take the whole block and draw again
            taken += counts
            continue
        done_at = max(
            int(np.flatnonzero(block == part)[missing[part] - 1]) for part in np.flatnonzero(missing > 0)
        )
        blocks.append(block[: done_at + 1])
        break
    chosen = np.concatenate(blocks)
    parts = active[chosen]
    items = np.empty(len(chosen), dtype=np.int64)
    for index, part in enumerate(active):
        where = np.flatnonzero(chosen == index)
        items[where] = np.arange(len(where)) % sizes[part]
    return parts.astype(np.int64), items


def weighted_mix(parts: list[list[Any]], weights: list[float], seed: int) -> list[Any]:
    """The weighted mix of in-memory lists (see :func:`weighted_picks`)."""
    which, items = weighted_picks([len(p) for p in parts], weights, seed)
    return [parts[p][i] for p, i in zip(which.tolist(), items.tolist(), strict=True)]


def weighted_mix_ids(parts: list[np.ndarray], weights: list[float], seed: int) -> np.ndarray:
    """The weighted mix of sample-id arrays: an array of sample ids (repeats share their stored tokens)."""
    which, items = weighted_picks([len(p) for p in parts], weights, seed)
    out = np.empty(len(which), dtype=np.int64)
    for index, part in enumerate(parts):
        where = np.flatnonzero(which == index)
        out[where] = part[items[where]]
    return out
