"""Megatron-LM indexed datasets: written by megatron-core's own builder, read back token for token, split by
documents as Megatron splits them, blended by weight, and trained on with ``type: causal``."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.data.megatron import IndexedDataset, split_bounds
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration


def megatron_builder():
    """Megatron's own writer (megatron-core, an optional test dependency: the tests skip without it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def write_megatron(prefix: Path, documents: list[list[list[int]]], dtype=np.uint16) -> None:
    """Documents of one or more sequences each, through ``IndexedDatasetBuilder``."""
    module = megatron_builder()
    builder = module.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in documents:
        builder.add_document(torch.tensor([t for s in sequences for t in s]), [len(s) for s in sequences])
    builder.finalize(f"{prefix}.idx")


def counting_documents(count: int, seed: int, vocab: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        start = int(rng.integers(5, vocab - 60))
        pieces = int(rng.integers(1, 4))
        documents.append([list(range(start + 7 * k, start + 7 * k + 7)) for k in range(pieces)])
    return documents


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reads_what_megatron_core_wrote(tmp_path: Path, dtype) -> None:
    documents = counting_documents(50, seed=1, vocab=1000)
    write_megatron(tmp_path / "corpus", documents, dtype)
    ours = IndexedDataset(str(tmp_path / "corpus"))
    theirs = megatron_builder().IndexedDataset(str(tmp_path / "corpus"))
    assert ours.documents == len(documents) == len(theirs.document_indices) - 1
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    for number, sequences in enumerate(documents):
        first, last = theirs.document_indices[number], theirs.document_indices[number + 1]
        expected = np.concatenate([theirs[i] for i in range(first, last)])
        assert ours.document(number).tolist() == expected.tolist() == [t for s in sequences for t in s]


@pytest.mark.parametrize(("ratio", "count"), [("969,30,1", 1000), ("98,2,0", 37), ("1", 5), ("2,1,1", 10)])
def test_document_splits_match_megatron(ratio: str, count: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")
    convert_split_vector_to_split_matrix = config.convert_split_vector_to_split_matrix
    parse_and_normalize_split = config.parse_and_normalize_split
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(ratio))
    bounds = split_bounds(ratio, count)
    for part, ends in enumerate(matrix):
        if ends is None:
            assert bounds[part] == bounds[part + 1]
        else:
            assert (bounds[part], bounds[part + 1]) == (round(ends[0] * count), round(ends[1] * count))


def test_causal_training_on_a_weighted_blend_with_a_document_split(base_config: dict, tmp_path: Path) -> None:
    write_megatron(tmp_path / "a", counting_documents(120, seed=2, vocab=1000))
    write_megatron(tmp_path / "b", counting_documents(40, seed=3, vocab=1000))
    source = {"type": "megatron", "split_ratio": "90,10,0"}
    config = merge(
        base_config,
        type="causal",
        epochs=4,
        optimizer={"lr": 3e-3},
        eval_interval=10,
        data={
            "sources": [
                {**source, "name_or_path": str(tmp_path / "a"), "split": "train", "sampling_weight": 1.0},
                {**source, "name_or_path": str(tmp_path / "b"), "split": "train", "sampling_weight": 2.0},
            ],
            "eval_sources": [{**source, "name_or_path": str(tmp_path / "a"), "split": "valid"}],
            "mix": "weighted",
            "pack_samples": True,
            "max_length": 128,
        },
        micro_batch_size=1,
    )
    result = train(config)
    evals = [h["eval_loss"] for h in result.state.history if "eval_loss" in h]
    assert len(evals) >= 3 and evals[-1] < evals[0] - 0.5
