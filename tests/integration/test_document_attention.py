"""Rows holding several documents (packed, padding-free) attend per document from bounds the collator
computes once: the masked whole-row attention's loss and gradients, with no mask over the row."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.data.collate import Collator
from posttrain.data.packing import join_samples
from posttrain.data.samples import IGNORE_INDEX, document_bounds
from posttrain.models import document_attention
from posttrain.models.document_attention import use_document_attention
from posttrain.models.sequence_parallel import SequenceSlicer
from posttrain.models.token_logps import row_nll
from posttrain.tiny_model import build_model

pytestmark = pytest.mark.integration

ROW = 8192
DOCUMENTS = 64


def _samples(count: int, total: int, seed: int = 0) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 240, size=count)
    lengths = (lengths * total / lengths.sum()).astype(int)
    lengths[-1] += total - lengths.sum()
    return [
        {"input_ids": rng.integers(5, 1000, n).tolist(), "labels": rng.integers(5, 1000, n).tolist()}
        for n in lengths
    ]


@pytest.fixture(scope="module")
def gqa_model() -> torch.nn.Module:
    """fp32, 4 query heads over 2 key/value heads, positions for a whole 8K row."""
    model = build_model(1024, max_position_embeddings=ROW, seed=1).float()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    return model


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = row_nll(model, batch).sum() / batch["num_target_tokens"]  # per token, as the loop divides
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(reference: tuple[float, dict], ours: tuple[float, dict]) -> None:
    assert abs(reference[0] - ours[0]) <= 1e-5
    assert max((reference[1][n] - ours[1][n]).abs().max().item() for n in reference[1]) <= 1e-5


@pytest.mark.parametrize(("implementation", "row"), [("sdpa", ROW), ("eager", ROW // 4)])
def test_64_documents_in_a_row_equal_the_masked_row(
    gqa_model: torch.nn.Module, implementation: str, row: int
) -> None:
    """sdpa at 8K tokens; eager (a materialised heads x row x row score matrix per layer) at 2K."""
    batch = Collator(0)([join_samples(_samples(DOCUMENTS, row))])
    assert batch["input_ids"].shape == (1, row) and len(batch["document_bounds"]) == DOCUMENTS + 1
    assert batch["document_bounds"].device.type == "cpu"
    masked = copy.deepcopy(gqa_model)
    masked.set_attn_implementation(implementation)  # transformers' block-diagonal mask over the row
    keep = ("input_ids", "labels", "position_ids", "num_target_tokens")
    reference = _loss_and_grads(masked, {k: batch[k] for k in keep})
    ours = copy.deepcopy(gqa_model)
    ours.set_attn_implementation(implementation)
    use_document_attention(ours)
    _assert_same(reference, _loss_and_grads(ours, batch))


def test_no_mask_reaches_attention_and_each_document_is_one_causal_call(
    gqa_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bounds come from the batch (no per-layer read of the positions), and what runs is causal
    attention per document with no mask."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple[int, Any, bool]] = []

    def spy(query: torch.Tensor, key: Any, value: Any, attn_mask: Any = None, **kwargs: Any) -> Any:
        calls.append((query.shape[2], attn_mask, kwargs.get("is_causal", False)))
        return sdpa(query, key, value, attn_mask, **kwargs)

    monkeypatch.setattr(document_attention, "derive_bounds", _refuse)
    monkeypatch.setattr(document_attention.F, "scaled_dot_product_attention", spy)
    model = copy.deepcopy(gqa_model)
    model.set_attn_implementation("sdpa")
    assert use_document_attention(model) == ""
    samples = _samples(DOCUMENTS, 2048, seed=3)
    batch = Collator(0)([join_samples(samples)])
    row_nll(model, batch).sum().backward()
    layers = model.config.num_hidden_layers
    assert len(calls) == DOCUMENTS * layers
    assert all(mask is None and causal for _, mask, causal in calls)
    assert [n for n, _, _ in calls[:DOCUMENTS]] == [len(s["input_ids"]) for s in samples]


def _refuse(*args: Any) -> None:
    raise AssertionError("the bounds were derived from the positions inside a layer")


def test_padding_free_rows_carry_the_bounds_and_equal_the_padded_batch(gqa_model: torch.nn.Module) -> None:
    samples = _samples(16, 1500, seed=5)
    flat = Collator(0, padding_free=True)(samples)
    padded = Collator(0)(samples)
    starts = np.cumsum([0, *[len(s["input_ids"]) for s in samples]])
    assert flat["document_bounds"].tolist() == starts.tolist()
    assert flat["cu_seq_lens_q"].tolist() == starts.tolist() and flat["max_length_q"] == max(np.diff(starts))
    ours = copy.deepcopy(gqa_model)
    ours.set_attn_implementation("sdpa")
    use_document_attention(ours)
    padded_model = copy.deepcopy(gqa_model)
    padded_model.set_attn_implementation("sdpa")
    _assert_same(_loss_and_grads(padded_model, padded), _loss_and_grads(ours, flat))


def test_bounds_and_attention_cost_per_batch() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    bounds = document_bounds(positions)
    assert bounds["document_bounds"].tolist() == [0, 3, 5, 9] and bounds["max_length_q"] == 4
    assert bounds["cu_seq_lens_q"].dtype == torch.int32 and bounds["num_attention_sq"] == 9 + 4 + 16
    padded = Collator(0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert padded["num_attention_sq"] == 9 + 1 and "document_bounds" not in padded


def test_sequence_parallel_slices_keep_the_bounds_of_the_whole_row() -> None:
    """Under Ulysses every rank attends over the gathered row: its bounds cover the padded whole row, and
    each rank counts its share of the attention cost."""
    samples = [
        {"input_ids": [1, 2, 3, 4], "labels": [IGNORE_INDEX, 2, 3, 4]},
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
    ]
    packed = join_samples(samples)
    halves = [SequenceSlicer(Collator(0), 0, 2, rank, rows=1)([packed]) for rank in (0, 1)]
    for half in halves:
        assert half["input_ids"].shape == (1, 4)  # 7 tokens padded to 8, split in two
        assert half["document_bounds"].tolist() == [0, 4, 8]  # the padding joins the last document
        assert half["num_attention_sq"] == (16 + 16) // 2


def test_the_compiled_operator_is_checked_by_torch_library() -> None:
    """Under torch.compile the documents run as one operator: its fake (meta) kernel, its registered
    gradient and its schema pass PyTorch's own operator checks."""
    query = torch.randn(1, 4, 60, 16, requires_grad=True)
    key, value = (torch.randn(1, 2, 60, 16, requires_grad=True) for _ in range(2))
    bounds = torch.tensor([0, 10, 30, 60])
    torch.library.opcheck(document_attention.causal_documents, (query, key, value, bounds, 0.25))
    eager = document_attention.causal_documents_eager(query, key, value, bounds, 0.25)
    assert torch.allclose(document_attention.causal_documents(query, key, value, bounds, 0.25), eager)
