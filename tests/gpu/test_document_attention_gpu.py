"""Per-document attention on a GPU: one varlen flash-attention call per layer for all documents, no host
sync inside attention, and the masked whole row's loss and gradients in bf16."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from posttrain.data.collate import Collator
from posttrain.data.packing import join_samples
from posttrain.models import document_attention
from posttrain.models.document_attention import per_document, use_document_attention
from posttrain.models.token_logps import row_nll
from posttrain.tiny_model import build_model

pytestmark = pytest.mark.gpu


def _packed(documents: int, total: int) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 240, size=documents)
    lengths = (lengths * total / lengths.sum()).astype(int)
    lengths[-1] += total - lengths.sum()
    samples = [
        {"input_ids": rng.integers(5, 1000, n).tolist(), "labels": rng.integers(5, 1000, n).tolist()}
        for n in lengths
    ]
    return Collator(0)([join_samples(samples)])


def _on_gpu(batch: dict) -> dict:
    """As the loop moves it: every tensor but the host-side bounds."""
    from posttrain.data.collate import to_device

    return to_device(batch, torch.device("cuda"))


def test_one_varlen_call_per_layer_and_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    if document_attention._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    calls = []
    real = document_attention._varlen_attn()

    @functools.wraps(real)  # its signature, which posttrain reads to call it
    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(document_attention, "_varlen_attn", lambda: counting)
    batch = _on_gpu(_packed(64, 8192))
    heads, dim = 8, 64
    query = torch.randn(1, heads, 8192, dim, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(1, 2, 8192, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    attention = per_document(lambda *a, **k: pytest.fail("the whole-row core ran"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        out, _ = attention(
            None,
            query,
            key,
            value,
            None,
            document_bounds=batch["document_bounds"],
            cu_seq_lens_q=batch["cu_seq_lens_q"],
            max_length_q=batch["max_length_q"],
            scaling=dim**-0.5,
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(calls) == 1 and out.shape == (1, 8192, heads, dim)


def test_bf16_documents_equal_the_masked_row_on_gpu() -> None:
    model = (
        build_model(1024, hidden_size=128, heads=4, max_position_embeddings=8192, seed=1).cuda().bfloat16()
    )
    batch = _packed(64, 8192)
    masked = copy.deepcopy(model)
    masked.set_attn_implementation("sdpa")
    reference = row_nll(masked, _on_gpu({k: batch[k] for k in ("input_ids", "labels", "position_ids")})).sum()
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("sdpa")
    assert use_document_attention(ours) == ""
    loss = row_nll(ours, _on_gpu(batch)).sum()
    assert torch.allclose(loss.float(), reference.float(), rtol=2e-2)
    reference.backward()
    loss.backward()
    for (name, a), (_, b) in zip(masked.named_parameters(), ours.named_parameters(), strict=True):
        # bf16 gradients of a summed loss over 8K tokens (the embedding's rows add many tokens' gradients in
        # bf16, in another order per kernel): compared as a whole, not element by element
        a, b = a.grad.float(), b.grad.float()
        assert torch.isfinite(b).all(), name
        assert (a - b).norm() <= 0.05 * a.norm(), (name, float((a - b).norm() / a.norm()))


@pytest.mark.parametrize("family", ["exaone4", "gemma2", "gemma3", "qwen2", "mistral"])
def test_per_layer_windows_packed_equal_padded_on_the_real_varlen_kernel(family: str) -> None:
    """Each layer's own window (sliding, or None on a full layer) in torch's varlen flash kernel, bf16: the
    packed row gives the padded batch's loss (the CPU tests run the same over stand-in kernels)."""
    if document_attention._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    from posttrain.data.collate import HostPrepared
    from tests.integration.test_sliding_windows import IMPLEMENTATION, _model, _samples

    samples = _samples()
    padded = _on_gpu(Collator(0)(samples))
    packed = _on_gpu(HostPrepared(Collator(0))([join_samples(samples)]))
    implementation = IMPLEMENTATION.get(family, "sdpa")
    masked = _model(family, torch.bfloat16).cuda()
    masked.set_attn_implementation(implementation)
    ours = _model(family, torch.bfloat16).cuda()
    ours.set_attn_implementation(implementation)
    assert use_document_attention(ours) == ""
    reference = row_nll(masked, padded).sum() / padded["num_target_tokens"]
    loss = row_nll(ours, packed).sum() / packed["num_target_tokens"]
    assert abs(float(reference - loss)) < 2e-2, (float(reference), float(loss))


def test_gemma3_image_blocks_on_the_real_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's packed rows with images in bf16: the documents in one varlen call per layer, those holding an
    image again with their blocks; each document's logits those of the document alone through transformers'
    masks (the CPU tests check the same to 1e-5 in float32, over stand-in kernels)."""
    if document_attention._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    from posttrain.data.collate import HostPrepared
    from tests.integration.test_image_blocks import _documents, _pixels, _types, tiny_gemma

    model, processor = tiny_gemma()
    model = model.to("cuda", torch.bfloat16)
    ours = copy.deepcopy(model)
    assert use_document_attention(ours) == ""
    documents = _documents(processor)
    calls = []
    real = document_attention._varlen_attn()

    @functools.wraps(real)
    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(document_attention, "_varlen_attn", lambda: counting)
    samples = [{"input_ids": ids, "labels": ids} for ids, _ in documents]
    packed = _on_gpu(HostPrepared(Collator(0))([join_samples(samples)]))
    inputs = {k: v for k, v in packed.items() if k not in ("labels", "target_rows")}
    inputs["token_type_ids"] = _types(packed["input_ids"], processor)
    pictures = {
        k: v.to("cuda", torch.bfloat16)
        for k, v in _pixels(processor, [p for _, ps in documents for p in ps]).items()
    }
    with torch.no_grad():
        logits = ours(**inputs, **pictures).logits[0].float()
    assert len(calls) == model.config.text_config.num_hidden_layers
    start = 0
    for ids, own in documents:
        row = torch.tensor([ids], device="cuda")
        alone = {"input_ids": row, "token_type_ids": _types(row, processor)}
        if own:
            alone |= {k: v.to("cuda", torch.bfloat16) for k, v in _pixels(processor, own).items()}
        with torch.no_grad():
            want = model(**alone).logits[0].float()
        got = logits[start : start + len(ids)]
        assert (got - want).norm() <= 2e-2 * want.norm(), float((got - want).norm() / want.norm())
        start += len(ids)
