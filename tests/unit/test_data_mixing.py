"""Weighted mixing (SiloGen's precomputed mix), the per-source eval split, and their config errors."""

from __future__ import annotations

from collections import Counter

import pytest

from posttrain.config import load_config
from posttrain.config.errors import ConfigError
from posttrain.data.mixing import split_rows, weighted_mix


def test_weighted_mix_uses_every_row_and_oversamples_the_small_heavy_source() -> None:
    big, small = [f"a{i}" for i in range(30)], [f"b{i}" for i in range(3)]
    mixed = weighted_mix([big, small], [1.0, 1.0], seed=7)
    counts = Counter(mixed)
    assert set(counts) == set(big) | set(small)  # every row of every source at least once
    assert sum(counts[b] for b in small) > len(small)  # the small source is drawn again and again
    assert mixed == weighted_mix([big, small], [1.0, 1.0], seed=7)  # seeded
    assert mixed != weighted_mix([big, small], [1.0, 1.0], seed=8)
    # drawing stops when the last source is used up: about len(big) / share(big) draws
    assert len(big) <= len(mixed) <= 3 * len(big)


def test_weight_zero_drops_a_source() -> None:
    assert weighted_mix([["a", "b"], ["c"]], [1.0, 0.0], seed=0) == ["a", "b"]


def test_split_is_seeded_disjoint_and_keeps_order() -> None:
    rows = list(range(50))
    train, held = split_rows(rows, 0.2, seed=3)
    assert len(held) == 10 and sorted(train + held) == rows and not set(train) & set(held)
    assert train == sorted(train) and (train, held) == split_rows(rows, 0.2, seed=3)
    assert split_rows(rows, 0.2, seed=4)[1] != held


def _errors(tmp_path, data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data={"model": {"name_or_path": "m"}, "data": data}, base_dir=tmp_path)
    return info.value.render()


def test_mix_config_errors(tmp_path) -> None:
    text = _errors(
        tmp_path, {"mix": "weighted", "sources": [{"name_or_path": "a.jsonl", "sampling_weight": -1}]}
    )
    assert "data.sources[0].sampling_weight" in text and "negative" in text
    assert "at least one source with sampling_weight > 0" in text
    text = _errors(tmp_path, {"sources": [{"name_or_path": "a.jsonl", "sampling_weight": 2}]})
    assert "only used with data.mix: weighted" in text
    text = _errors(tmp_path, {"mix": "shuffle", "sources": ["a.jsonl"]})
    assert "data.mix" in text and "concatenate" in text
