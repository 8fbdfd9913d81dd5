from __future__ import annotations

import torch

from posttrain.data.collate import Collator
from posttrain.data.packing import pack_sequential
from posttrain.data.samples import IGNORE_INDEX

X = IGNORE_INDEX


def test_pack_sequential_restarts_positions_and_masks_first_labels() -> None:
    samples = [
        {"input_ids": [1, 2, 3], "labels": [X, 2, 3]},
        {"input_ids": [4, 5], "labels": [4, 5]},
        {"input_ids": [6, 7, 8, 9], "labels": [X, X, 8, 9]},
    ]
    packed = pack_sequential(samples, max_length=6)
    assert [p["input_ids"] for p in packed] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert packed[0]["position_ids"] == [0, 1, 2, 0, 1]
    assert packed[0]["labels"] == [X, 2, 3, X, 5]  # the 2nd sample's first label would cross the boundary
    assert packed[1]["position_ids"] == [0, 1, 2, 3]


def test_collate_pads_and_counts_target_tokens() -> None:
    batch = Collator(pad_id=0)(
        [{"input_ids": [5, 6, 7], "labels": [X, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[X, 6, 7], [8, X, X]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["num_target_tokens"] == 2  # the first position of each row is never a target
    assert batch["num_input_tokens"] == 4
    assert "position_ids" not in batch


def test_collate_packed_passes_positions_without_mask() -> None:
    packed = pack_sequential(
        [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3, 4], "labels": [3, 4]}], 8
    )
    batch = Collator(pad_id=0)(packed)
    assert "attention_mask" not in batch
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 1, 0, 1]]))
    assert batch["num_target_tokens"] == 2


def test_best_fit_keeps_every_sample_whole_and_fills_sequences() -> None:
    import random

    from posttrain.data.packing import pack_best_fit, packing_efficiency

    rng = random.Random(0)
    samples = []
    for index in range(300):
        n = rng.randint(3, 60)
        samples.append({"input_ids": [index] * n, "labels": [index] * n})
    packed = pack_best_fit(samples, max_length=128)
    sequential = pack_sequential(samples, max_length=128)
    assert all(len(s["input_ids"]) <= 128 for s in packed)
    # every sample appears exactly once, contiguous, with positions 0..n-1 and its first label ignored
    seen = {}
    for sequence in packed:
        ids, positions, labels = sequence["input_ids"], sequence["position_ids"], sequence["labels"]
        for start in (i for i, p in enumerate(positions) if p == 0):
            n = len(samples[ids[start]]["input_ids"])
            assert ids[start : start + n] == [ids[start]] * n and positions[start : start + n] == list(
                range(n)
            )
            assert labels[start] == IGNORE_INDEX and labels[start + 1 : start + n] == [ids[start]] * (n - 1)
            seen[ids[start]] = seen.get(ids[start], 0) + 1
    assert seen == dict.fromkeys(range(300), 1)
    assert packing_efficiency(packed, 128) >= 0.97 > packing_efficiency(sequential, 128)
