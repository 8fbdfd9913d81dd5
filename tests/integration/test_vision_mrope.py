"""The Qwen-VL family's M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) in the trainer's forward: padded, packed and joined (padding-free) rows give
each token the log-probability the model gives it on its document alone, with the inputs its processor makes;
generation gives the image tokens' types to the model and each prompt's completion as generated alone.

The processors of this family need torchvision (transformers builds their video processor with it), which
imports only in the vision tier's venv (``make test-vision``: the processors' path is tested there, in
test_vision.py), so these tests, which run in every venv, build the model alone and make its image inputs with
the family's Pillow image processor and its ids by hand: ``<|vision_start|>``, one ``<|image_pad|>`` per merged
patch, ``<|vision_end|>``, as the processor writes them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from posttrain.data.collate import Collator, HostPrepared
from posttrain.data.packing import join_samples
from posttrain.data.samples import IGNORE_INDEX, JOINED, joined_rows, pad_rows
from posttrain.models.document_attention import use_document_attention
from posttrain.models.token_logps import token_logps

IMAGE, VIDEO, START, END, PAD = 290, 291, 292, 293, 0


def tiny_qwen_vl(arch: str) -> Any:
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # M-RoPE: of the 8 rotary frequencies of a 16-wide head, 2 for time, 3 for height, 3 for width
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": PAD,
    }
    shape = {"depth": 2, "num_heads": 2, "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if arch == "qwen2_vl":
        vision = shape | {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
    elif arch == "qwen3_vl":  # interleaved M-RoPE, learned position embeddings, deepstack features
        text["head_dim"] = 16
        text["rope_parameters"] |= {"mrope_interleaved": True}
        vision = shape | {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        }
    else:  # Qwen2.5-VL: windowed attention in the tower, an output width of its own
        vision = shape | {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "window_size": 16,
            "fullatt_block_indexes": [1],
        }
    config = AutoConfig.for_model(
        arch,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()


def images_inputs(pictures: list[Any]) -> dict[str, torch.Tensor]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, temporal_patch_size=2, merge_size=2
    )
    out = processor(images=pictures, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def document(words: list[int], pictures: list[Any]) -> tuple[list[int], list[Any]]:
    """A document's ids: text, then each image as the processor expands it, with text between."""
    ids = [1, *words[:2]]
    for picture in pictures:
        grid = images_inputs([picture])["image_grid_thw"][0]
        ids += [START, *[IMAGE] * int(grid.prod() // 4), END, *words[2:4]]
    return [*ids, *words[4:], 2], pictures


def alone(model: Any, ids: list[int], pictures: list[Any]) -> torch.Tensor:
    """The log-probability of each next token of the document alone, inputs as the processor makes them (the
    model computes its M-RoPE positions itself)."""
    row = torch.tensor([ids])
    inputs: dict[str, Any] = {"input_ids": row, "mm_token_type_ids": (row == IMAGE).long()}
    if pictures:
        inputs |= images_inputs(pictures)
    with torch.no_grad():
        logits = model(**inputs).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, row[0, 1:, None])[:, 0]


def labels_of(ids: list[int]) -> list[int]:
    return [IGNORE_INDEX if i in (IMAGE, START, END) or n == 0 else i for n, i in enumerate(ids)]


@pytest.fixture(scope="module")
def documents() -> list[tuple[list[int], list[Any]]]:
    from PIL import Image

    red, blue = Image.new("RGB", (32, 32), (200, 10, 10)), Image.new("RGB", (32, 32), (10, 10, 200))
    noise = Image.frombytes("RGB", (16, 32), bytes(range(256)) * 6)  # a 1x2 grid of merged patches
    return [
        document([5, 6, 7, 8, 9, 10], [red]),
        document([11, 12, 13, 14, 15], []),
        document([16, 17, 18, 19, 20, 21, 22], [blue, noise]),
    ]


def trained(ids: list[int]) -> torch.Tensor:
    """The positions of a document that predict a label (the trainer's ``target_labels``)."""
    labels = torch.tensor(labels_of(ids))
    return (labels[1:] != IGNORE_INDEX).nonzero().squeeze(1)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_padded_packed_and_joined_rows_give_each_token_its_documents_own_log_probability(
    arch: str, documents: list[tuple[list[int], list[Any]]]
) -> None:
    model = tiny_qwen_vl(arch)
    expected = [alone(model, ids, pictures) for ids, pictures in documents]
    pictures = [p for _, ps in documents for p in ps]
    image_inputs = images_inputs(pictures)
    samples = [{"input_ids": ids, "labels": labels_of(ids)} for ids, _ in documents]

    def check(found: torch.Tensor, index: int, start: int = 0) -> None:
        """The trainer's log-probabilities of document ``index``, from ``start`` in ``found`` (one row)."""
        at = trained(documents[index][0])
        got, want = found[start + at].double(), expected[index][at]
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (index, (got - want).abs().max())

    # padded rows: the model computes M-RoPE itself, from the modality types the trainer now passes
    padded = dict(HostPrepared(Collator(PAD))(samples)) | image_inputs
    logps, _ = token_logps(model, padded)
    for row in range(3):
        check(logps[row], row)

    # one packed row (positions restart per document): transformers' masked row, then per-document attention
    packed = dict(HostPrepared(Collator(PAD))([join_samples(samples)])) | image_inputs
    starts = [0, len(samples[0]["input_ids"]), len(samples[0]["input_ids"]) + len(samples[1]["input_ids"])]
    logps, _ = token_logps(model, packed)
    for index, start in enumerate(starts):
        check(logps[0], index, start)
    # the failure this guards against: the packed row's plain positions put every image token on a line
    plain = {k: packed[k] for k in ("input_ids", "position_ids")} | image_inputs
    with torch.no_grad():
        logits = model(**plain, mm_token_type_ids=(packed["input_ids"] == IMAGE).long()).logits[0, :-1]
    wrong = torch.log_softmax(logits.double(), -1).gather(1, packed["input_ids"][0, 1:, None])[:, 0]
    at = trained(documents[0][0])
    assert (wrong[at] - expected[0][at]).abs().max() > 1e-3

    assert use_document_attention(model) == ""
    logps, _ = token_logps(model, packed)
    for index, start in enumerate(starts):
        check(logps[0], index, start)

    # joined rows (online padding-free micro-batches): the padded batch run as one row of its documents
    input_ids, labels, attention = pad_rows([(s["input_ids"], s["labels"]) for s in samples], PAD)
    joined = {"input_ids": input_ids, "labels": labels, "attention_mask": attention, **image_inputs}
    joined[JOINED] = joined_rows(input_ids, attention)
    logps, _ = token_logps(model, joined)
    for row in range(3):
        check(logps[row], row)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_generation_reads_the_images_with_their_3d_positions(
    arch: str, documents: list[tuple[list[int], list[Any]]]
) -> None:
    """transformers' ``generate`` through the trainer's engine (left-padded prompts with images) gives each
    prompt's greedy completion as the model generates it alone from the processor's inputs."""
    from types import SimpleNamespace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from posttrain.generation.transformers_engine import TransformersEngine, split_completions
    from posttrain.generation.types import Sampling

    model = tiny_qwen_vl(arch)
    pictures = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, temporal_patch_size=2, merge_size=2
    )
    # the engine asks a processor only for its image processor (the Qwen processor itself needs torchvision)
    engine = TransformersEngine([2], PAD, SimpleNamespace(image_processor=pictures))
    prompts = [ids[:-1] for ids, images in documents if images]  # the documents with images, their end cut
    images = [images for _, images in documents if images]
    assert len({len(p) for p in prompts}) == 2  # left padding in the batch
    seen: list[dict[str, Any]] = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs), with_kwargs=True)
    got = engine.generate(model, prompts, Sampling(max_new_tokens=5), None, images=images)
    hook.remove()
    first = seen[0]  # the prefill: every prompt token's modality, as the processor would mark it
    assert torch.equal(first["mm_token_type_ids"], (first["input_ids"] == IMAGE).long())
    for prompt, own, ids in zip(prompts, images, got.ids, strict=True):
        row = torch.tensor([prompt])
        inputs = {"input_ids": row, "mm_token_type_ids": (row == IMAGE).long(), **images_inputs(own)}
        with torch.no_grad():
            alone = model.generate(
                **inputs, max_new_tokens=5, do_sample=False, eos_token_id=[2], pad_token_id=PAD
            )
        assert split_completions(alone[:, row.shape[1] :], [2], PAD).ids[0] == ids


def test_the_modality_types_are_given_where_they_mean_modalities() -> None:
    """Qwen-VL reads ``mm_token_type_ids``; PaliGemma's ``token_type_ids`` mean the prompt against the answer
    (bidirectional over the prompt), not modalities, so none are derived for it (Gemma 3's are: the vision
    tests)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from posttrain.vision.collate import token_type_keys

    assert token_type_keys(tiny_qwen_vl("qwen2_5_vl")) == ("mm_token_type_ids",)
    config = AutoConfig.for_model(
        "paligemma",
        text_config={"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
        vision_config={"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "patch_size": 8},
        image_token_id=IMAGE,
    )
    assert token_type_keys(AutoModelForImageTextToText.from_config(config)) == ()
