"""Gemma 3's image blocks under per-document attention: an image's tokens see each other both ways (on a
windowed layer, within the window before them and the rest of their image after), in packed rows, in rows
without documents and on the varlen path, equal to each document alone through transformers' own masks; the
compiled operator's gradients; no device read in attention; models whose blocks are found otherwise keep
transformers' masked row."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from posttrain.data.collate import Collator, HostPrepared
from posttrain.data.packing import join_samples
from posttrain.models import document_attention
from posttrain.models.document_attention import (
    blocks_by_document,
    causal_documents,
    causal_documents_eager,
    image_blocks,
    per_document,
    unsupported_by_documents,
    use_document_attention,
)
from tests import varlen_stand_ins as stand_ins
from tests.device_reads import DeviceReads

pytestmark = pytest.mark.integration

WINDOW = 3  # smaller than an image's 4 tokens: the window cuts inside a block


def tiny_gemma() -> tuple[Any, Any]:
    """A tiny Gemma 3 (a sliding layer, then a full one) with a window of 3, in sdpa, and its processor."""
    from posttrain.vision.tiny import build_tiny_vlm

    model, processor = build_tiny_vlm("gemma3", vocab_size=512)
    model.config.text_config.sliding_window = WINDOW
    for module in model.modules():
        if getattr(module, "sliding_window", None):
            module.sliding_window = WINDOW
    model.set_attn_implementation("sdpa")
    return model.eval(), processor


@pytest.fixture(scope="module")
def gemma() -> tuple[Any, Any]:
    return tiny_gemma()


def _tokens(processor: Any) -> dict[str, int]:
    tokenizer = processor.tokenizer
    names = {"begin": "<start_of_image>", "image": "<image_soft_token>", "end": "<end_of_image>"}
    return {k: tokenizer.convert_tokens_to_ids(v) for k, v in names.items()} | {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
    }


def _documents(processor: Any) -> list[tuple[list[int], list[Any]]]:
    """Four documents, as Gemma 3's processor lays out an image (begin, 4 image tokens, end): one image,
    none, two images a word apart, and one image first."""
    from PIL import Image

    t = _tokens(processor)
    image = [t["begin"], *[t["image"]] * 4, t["end"]]
    colours = [
        Image.new("RGB", (32, 32), c) for c in ((200, 10, 10), (10, 200, 10), (10, 10, 200), (90, 90, 9))
    ]
    return [
        ([t["bos"], 40, 41, *image, 42, 43, 44, t["eos"]], colours[:1]),
        ([t["bos"], 50, 51, 52, 53, 54, 55, 56, t["eos"]], []),
        ([t["bos"], 60, *image, 61, *image, 62, 63, t["eos"]], colours[1:3]),
        ([t["bos"], *image, 70, 71, 72, 73, 74, t["eos"]], colours[3:]),
    ]


def _pixels(processor: Any, pictures: list[Any]) -> dict[str, torch.Tensor]:
    return {"pixel_values": processor.image_processor(images=pictures, return_tensors="pt")["pixel_values"]}


def _types(ids: torch.Tensor, processor: Any) -> torch.Tensor:
    return (ids == _tokens(processor)["image"]).long()


def _alone(model: Any, processor: Any, ids: list[int], pictures: list[Any]) -> torch.Tensor:
    """The document's logits on its own, through transformers' masks (sdpa: causal, window, image blocks)."""
    row = torch.tensor([ids])
    inputs = {"input_ids": row, "token_type_ids": _types(row, processor)}
    if pictures:
        inputs |= _pixels(processor, pictures)
    with torch.no_grad():
        return model(**inputs).logits[0]


def test_packed_rows_and_rows_without_documents_give_each_documents_own_logits(
    gemma: tuple[Any, Any],
) -> None:
    model, processor = gemma
    documents = _documents(processor)
    expected = [_alone(model, processor, ids, pictures) for ids, pictures in documents]
    pictures = _pixels(processor, [p for _, ps in documents for p in ps])
    ours = copy.deepcopy(model)
    assert unsupported_by_documents(ours) == ""
    assert use_document_attention(ours) == ""
    samples = [{"input_ids": ids, "labels": ids} for ids, _ in documents]
    packed = HostPrepared(Collator(0))([join_samples(samples)])
    inputs = {k: v for k, v in packed.items() if k not in ("labels", "target_rows")}
    inputs["token_type_ids"] = _types(packed["input_ids"], processor)
    with torch.no_grad():
        logits = ours(**inputs, **pictures).logits[0]
    start = 0
    for index, (ids, _) in enumerate(documents):
        got = logits[start : start + len(ids)]
        assert torch.allclose(got, expected[index], atol=1e-5, rtol=0), (
            index,
            (got - expected[index]).abs().max(),
        )
        start += len(ids)
    # under a LoRA adapter (PEFT wraps the model before the run switches its attention): the same logits
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert use_document_attention(adapted) == ""
    with torch.no_grad():
        found = adapted(**inputs, **pictures).logits[0]
    assert torch.allclose(found, logits, atol=1e-5, rtol=0)  # LoRA's B starts at zero
    # the failure guarded against: the image tokens attended causally only (the blocks left out)
    with torch.no_grad():
        causal = ours(
            **{**inputs, "image_blocks": image_blocks(torch.zeros_like(inputs["input_ids"]))}, **pictures
        )
    assert (causal.logits[0, : len(documents[0][0])] - expected[0]).abs().max() > 1e-3

    # rows without documents and without padding: two documents of one length, one per row, no mask
    rows = [documents[0], documents[3]]
    assert len(rows[0][0]) == len(rows[1][0])
    batch = torch.tensor([ids for ids, _ in rows])
    both = _pixels(processor, [p for _, ps in rows for p in ps])
    with torch.no_grad():
        logits = ours(input_ids=batch, token_type_ids=_types(batch, processor), **both).logits
    for row, index in enumerate((0, 3)):
        assert torch.allclose(logits[row], expected[index], atol=1e-5, rtol=0), row
    # one document alone, no mask: the blocks still apply
    with torch.no_grad():
        single = ours(
            input_ids=batch[:1], token_type_ids=_types(batch[:1], processor), **_pixels(processor, rows[0][1])
        )
    assert torch.allclose(single.logits[0], expected[0], atol=1e-5, rtol=0)


def test_padded_rows_and_generation_keep_transformers_mask_with_the_blocks(gemma: tuple[Any, Any]) -> None:
    """A right-padded batch (an attention mask) is attended over transformers' mask, blocks included, and
    greedy generation through the trainer's engine gives each prompt's completion alone."""
    from posttrain.generation.transformers_engine import TransformersEngine
    from posttrain.generation.types import Sampling

    model, processor = gemma
    documents = _documents(processor)
    ours = copy.deepcopy(model)
    use_document_attention(ours)
    rows = [documents[0], documents[2]]
    longest = max(len(ids) for ids, _ in rows)
    batch = torch.tensor([ids + [0] * (longest - len(ids)) for ids, _ in rows])
    mask = (batch != 0).long()
    pictures = _pixels(processor, [p for _, ps in rows for p in ps])
    with torch.no_grad():
        logits = ours(
            input_ids=batch, attention_mask=mask, token_type_ids=_types(batch, processor), **pictures
        ).logits
    for row, (ids, own) in enumerate(rows):
        want = _alone(model, processor, ids, own)
        assert torch.allclose(logits[row, : len(ids)], want, atol=1e-5, rtol=0), row

    t = _tokens(processor)
    engine = TransformersEngine([t["eos"]], 0, processor)
    prompts = [ids[:-1] for ids, _ in rows]
    got = engine.generate(ours, prompts, Sampling(max_new_tokens=4), None, images=[own for _, own in rows])
    for prompt, (_, own), completion in zip(prompts, rows, got.ids, strict=True):
        alone = engine.generate(model, [prompt], Sampling(max_new_tokens=4), None, images=[own])
        assert alone.ids[0] == completion


def test_joined_rows_give_the_padded_rows_log_probabilities(gemma: tuple[Any, Any]) -> None:
    """An online method's padding-free micro-batch (the padded rows joined into one): the trainer's
    log-probabilities equal the padded batch's through transformers' masks."""
    from posttrain.data.samples import JOINED, joined_rows, pad_rows
    from posttrain.models.token_logps import token_logps

    model, processor = gemma
    documents = _documents(processor)
    ours = copy.deepcopy(model)
    use_document_attention(ours)
    input_ids, labels, attention = pad_rows([(ids, ids) for ids, _ in documents], 0)
    padded = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
    padded |= _pixels(processor, [p for _, ps in documents for p in ps])
    with torch.no_grad():
        want, _ = token_logps(model, padded)
        got, _ = token_logps(ours, padded | {JOINED: joined_rows(input_ids, attention)})
    real = attention[:, 1:].bool()  # the positions that predict a real token
    got, want = got[:, :-1], want[:, :-1]
    assert torch.allclose(got[real], want[real], atol=1e-5, rtol=0), (got[real] - want[real]).abs().max()


def _qkv(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, tokens, 16, generator=generator).to(dtype)
    key, value = (torch.randn(1, 2, tokens, 16, generator=generator).to(dtype) for _ in range(2))
    return query, key, value


def _reference(
    query: Any, key: Any, value: Any, bounds: list[int], blocks: list[tuple[int, int]], window: int
) -> Any:
    """float32 attention over the whole row with the mask written out: same document, and causal or same
    image block, and within the window before."""
    tokens = query.shape[2]
    index = torch.arange(tokens)
    document = torch.bucketize(index, torch.tensor(bounds[1:]), right=True)
    group = torch.full((tokens,), -1)
    for number, (start, end) in enumerate(blocks):
        group[start:end] = number
    allowed = (index[None, :] <= index[:, None]) | (
        (group[:, None] == group[None, :]) & (group[:, None] >= 0)
    )
    if window:
        allowed &= index[None, :] > index[:, None] - window
    allowed &= document[:, None] == document[None, :]
    q, k, v = (x.float() for x in (query, key, value))
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=0.25, enable_gqa=True
    )


BOUNDS = [0, 12, 20, 41, 50]
BLOCKS = [(3, 7), (22, 26), (27, 31), (41, 45)]  # none in the second document; one starts the fourth


@pytest.mark.parametrize("window", [0, WINDOW])
def test_the_varlen_path_keeps_one_call_and_redoes_only_the_documents_with_images(window: int) -> None:
    query, key, value = _qkv(BOUNDS[-1], torch.bfloat16)
    bounds, blocks = torch.tensor(BOUNDS), torch.tensor(BLOCKS)
    assert blocks_by_document(BOUNDS, blocks) == {0: [(3, 7)], 2: [(2, 6), (7, 11)], 3: [(0, 4)]}
    with stand_ins.varlen_on_cpu(stand_ins.varlen_2_13):
        out = causal_documents_eager(query, key, value, bounds, 0.25, window=window, blocks=blocks)
        assert stand_ins.CALLS == ["2.13"]
    want = _reference(query, key, value, BOUNDS, BLOCKS, window)
    assert torch.allclose(out.float(), want, atol=2e-2)
    plain = causal_documents_eager(
        *(x.float() for x in (query, key, value)), bounds, 0.25, window=window, blocks=blocks
    )
    assert torch.allclose(plain, want, atol=1e-5)


def test_the_compiled_operator_gives_the_eager_gradients_and_reads_nothing_back() -> None:
    query, key, value = (x.requires_grad_() for x in _qkv(BOUNDS[-1], torch.float32))
    bounds, blocks = torch.tensor(BOUNDS), torch.tensor(BLOCKS)
    torch.library.opcheck(causal_documents, (query, key, value, bounds, 0.25, WINDOW, blocks))
    grads = {}
    for name, function in {"eager": causal_documents_eager, "operator": causal_documents}.items():
        out = function(query, key, value, bounds, 0.25, window=WINDOW, blocks=blocks)
        grads[name] = torch.autograd.grad(out.square().sum(), (query, key, value))
    for ours, want in zip(grads["operator"], grads["eager"], strict=True):
        assert torch.allclose(ours, want, atol=1e-5)
    attention = per_document(lambda *a, **k: pytest.fail("the whole-row core ran"))
    with DeviceReads([bounds, blocks]) as mode:
        attention(None, query, key, value, None, scaling=0.25, document_bounds=bounds, image_blocks=blocks)
    assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)


def test_image_blocks_are_runs_of_image_tokens_that_never_cross_a_row() -> None:
    types = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 1]])
    assert image_blocks(types).tolist() == [[1, 3], [4, 6], [6, 8], [11, 12]]
    assert image_blocks(torch.zeros(2, 3, dtype=torch.long)).shape == (0, 2)


def test_models_that_find_their_blocks_otherwise_keep_the_masked_row(
    gemma: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose transformers module builds image blocks that per-document attention does not find as
    it does (Molmo2; here Gemma 3 with its family taken off the list) keeps transformers' masked
    row."""
    model, _ = gemma
    other = copy.deepcopy(model)
    assert document_attention.has_image_blocks(other) and document_attention.image_blocks_known(other)
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):  # Molmo2 as its default config builds it, no weights allocated
        molmo = AutoModelForImageTextToText.from_config(AutoConfig.for_model("molmo2"))
    assert "block_sequence_ids" in unsupported_by_documents(molmo)
    monkeypatch.setattr(document_attention, "IMAGE_BLOCK_MODELS", frozenset())
    assert "block_sequence_ids" in unsupported_by_documents(other)
    assert use_document_attention(other) != ""
    assert other.config.text_config._attn_implementation == "sdpa"
