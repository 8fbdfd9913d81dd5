"""The memory-mapped sample store, the views over it, the packers on lengths and the shard sampler."""

from __future__ import annotations

import bisect
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from posttrain.data.causal import concat_blocks
from posttrain.data.packing import best_fit_bins, pack_best_fit, pack_sequential, sequential_bins
from posttrain.data.sampler import shard_order
from posttrain.data.samples import IGNORE_INDEX
from posttrain.data.store import SampleStore, StoreWriter
from posttrain.data.views import BlockView, EvalShard, PackedView, SampleView

X = IGNORE_INDEX


def write_store(directory: Path, samples: list[dict[str, list[int]]], batch: int = 3) -> SampleStore:
    writer = StoreWriter(directory, ("input_ids", "labels"))
    for start in range(0, len(samples), batch):
        part = samples[start : start + batch]
        flat = {c: np.concatenate([np.array(s[c]) for s in part]) for c in ("input_ids", "labels")}
        lengths = {c: np.array([len(s[c]) for s in part]) for c in ("input_ids", "labels")}
        writer.append(flat, lengths)
    writer.close()
    return SampleStore(directory)


def random_samples(count: int, seed: int = 0, longest: int = 60) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        n = rng.randint(2, longest)
        ids = [index * 1000 + k for k in range(n)]
        labels = [X if rng.random() < 0.3 else t for t in ids]
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def as_lists(item: dict) -> dict:
    return {key: np.asarray(value).tolist() for key, value in item.items()}


def test_store_round_trip_is_memory_mapped_and_pickles_as_a_path(tmp_path: Path) -> None:
    samples = random_samples(10)
    store = write_store(tmp_path / "s", samples)
    assert store.count == 10
    for index, sample in enumerate(samples):
        assert store.get("input_ids", index).tolist() == sample["input_ids"]
        assert store.get("labels", index).tolist() == sample["labels"]
        assert store.trained("labels")[index] == sum(1 for x in sample["labels"][1:] if x != X)
    assert isinstance(store.tokens("input_ids"), np.memmap)
    copy = pickle.loads(pickle.dumps(store))
    assert copy._maps == {} and copy.get("labels", 3).tolist() == samples[3]["labels"]
    assert len(pickle.dumps(store)) < 1000  # no tokens travel to worker processes


def best_fit_reference(lengths: list[int], capacity: int) -> list[list[int]]:
    """The straightforward O(n^2) best-fit decreasing the O(n log n) packer must reproduce exactly."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []
    for index in order:
        at = bisect.bisect_left(room, (lengths[index], -1))
        if at == len(room):
            bins.append([index])
            bisect.insort(room, (capacity - lengths[index], len(bins) - 1))
            continue
        free, slot = room.pop(at)
        bins[slot].append(index)
        bisect.insort(room, (free - lengths[index], slot))
    return bins


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_bins_equal_the_quadratic_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 200, size=2000)
    offsets, members = best_fit_bins(lengths, 256)
    bins = [members[offsets[k] : offsets[k + 1]].tolist() for k in range(len(offsets) - 1)]
    assert bins == best_fit_reference(lengths.tolist(), 256)


def test_packed_view_equals_packing_in_memory(tmp_path: Path) -> None:
    samples = random_samples(40)
    store = write_store(tmp_path / "s", samples)
    ids = np.arange(40)
    lengths = store.lengths()[ids]
    for bins, expected in (
        (best_fit_bins(lengths, 128), pack_best_fit(samples, 128)),
        (sequential_bins(lengths, 128), pack_sequential(samples, 128)),
    ):
        view = PackedView(store, (ids, np.zeros_like(ids), lengths), *bins)
        assert [as_lists(item) for item in view] == expected
        assert view.trained_tokens() == sum(sum(1 for x in s["labels"][1:] if x != X) for s in expected)
        assert view.lengths().tolist() == [len(s["input_ids"]) for s in expected]


def test_block_view_equals_concatenated_blocks(tmp_path: Path) -> None:
    documents = [{"input_ids": s["input_ids"], "labels": s["input_ids"]} for s in random_samples(30)]
    store = write_store(tmp_path / "s", documents)
    order = np.array([3, 1, 2, 0, *range(4, 30)])
    view = BlockView(store, order, 50)
    expected = concat_blocks([documents[i] for i in order], 50)
    assert [as_lists(item) for item in view] == expected
    assert view.trained_tokens() == sum(len(b["input_ids"]) - 1 for b in expected)


def test_views_repeat_and_cut_without_touching_the_store(tmp_path: Path) -> None:
    samples = random_samples(5)
    view = SampleView(write_store(tmp_path / "s", samples), np.array([4, 2]))
    assert [as_lists(i)["input_ids"] for i in view.repeat(2)] == [
        samples[k]["input_ids"] for k in (4, 2, 4, 2)
    ]
    assert len(view.head(1)) == 1


def test_eval_shards_have_equal_counts_and_label_free_padding(tmp_path: Path) -> None:
    samples = random_samples(5)
    view = SampleView(write_store(tmp_path / "s", samples), np.arange(5))
    shards = [EvalShard(view, rank, 2) for rank in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    filler = shards[1][2]
    assert set(filler["labels"].tolist()) == {X}
    assert as_lists(shards[1][0]) == samples[1]


@pytest.mark.parametrize(("count", "world"), [(10, 1), (10, 3), (7, 2), (1, 2), (101, 4)])
def test_shard_order_is_distributed_samplers(count: int, world: int) -> None:
    for rank in range(world):
        for epoch in range(2):
            sampler = DistributedSampler(range(count), world, rank, shuffle=True, seed=5)
            sampler.set_epoch(epoch)
            assert shard_order(count, world, rank, 5, epoch).tolist() == list(sampler)


def test_a_waiting_process_stops_on_the_builders_failure_note_but_not_on_an_old_one(tmp_path: Path) -> None:
    import os
    import time

    import psutil

    from posttrain.data.cache import _wait_for_store
    from posttrain.errors import DataError

    failed = tmp_path / ".failed-key"
    failed.write_text("bad.jsonl row 2: missing 'messages'")
    with pytest.raises(DataError, match=r"another process failed: bad\.jsonl row 2"):
        _wait_for_store(tmp_path / "key", failed)
    old = psutil.Process().create_time() - 60  # written by an earlier run: ignored
    os.utime(failed, (old, old))
    (tmp_path / "key").mkdir()
    (tmp_path / "key" / "reports.json").write_text("{}")
    started = time.perf_counter()
    _wait_for_store(tmp_path / "key", failed)
    assert time.perf_counter() - started < 5
