"""Image batches: the micro-batch's images opened again and put through the processor's image processor,
beside the token batch the method's collator makes; for the online methods, the image inputs of each
generated micro-batch (``attach_images``) and of generation itself (``image_inputs``).

The images of a batch row are those of its samples in order (a packed or padding-free row holds several
samples, and their images one after another), which is the order of the image tokens in the row: the model
puts each image's features in place of its tokens in that order.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

from posttrain.data.collate import CollatorWrapper
from posttrain.vision import images
from posttrain.vision.processor import is_vision_language, processor_of

#: the image processors' outputs a model's forward takes (the rest, Idefics3's rows and columns, are not
#: model inputs)
IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")
#: the per-token modality inputs a vision-language model's forward may read (1 at an image's tokens, 2 at a
#: video's, as the processors make them): Gemma 3's ``token_type_ids`` (an image's tokens attend to each
#: other both ways) and the Qwen-VL family's ``mm_token_type_ids`` (without them transformers gives the image
#: tokens plain 1-D positions instead of M-RoPE's 3-D ones). Derived from the ids at every forward, so every
#: layout of the rows (padded, packed, joined, a KTO's KL rows, generation's prompts) gets them.
TOKEN_TYPE_INPUTS = ("token_type_ids", "mm_token_type_ids")
#: the families whose ``token_type_ids`` are those modality types (their processors rename
#: ``mm_token_type_ids``); elsewhere the name means something else (PaliGemma's: the prompt against the
#: answer), and it is left to the model's own default
MODALITY_TOKEN_TYPE_IDS = frozenset({"gemma3", "gemma3n"})


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def token_type_keys(model: Any) -> tuple[str, ...]:
    """The modality inputs (``TOKEN_TYPE_INPUTS``) this Hugging Face model's forward takes; none for a text
    model."""
    config = getattr(model, "config", None)
    if not is_vision_language(config):
        return ()
    accepted = _forward_parameters(type(model))
    if getattr(config, "model_type", None) not in MODALITY_TOKEN_TYPE_IDS:
        accepted -= {"token_type_ids"}
    return tuple(key for key in TOKEN_TYPE_INPUTS if key in accepted)


def token_types(model: Any, input_ids: Any) -> dict[str, Any]:
    """The modality inputs the model reads for ``input_ids`` (the processor's ``mm_token_type_ids``: 1 at
    the config's image token, 2 at its video token, 0 elsewhere); empty when it reads none."""
    keys = token_type_keys(model)
    if not keys:
        return {}
    types = input_ids.new_zeros(input_ids.shape)
    for value, name in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(model.config, name, None)
        if token is not None:
            types = types.masked_fill(input_ids == token, value)
    return dict.fromkeys(keys, types)


class ImageBatches(CollatorWrapper):
    """Wraps the run's collator: the samples' image references are taken out before it sees them and the
    image inputs added to its batch, with ``num_images``, the micro-batch's images counted on the host."""

    def __init__(self, collate: Any, processor: Any) -> None:
        super().__init__(collate)
        self.processor = processor

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        per_sample = [images.decode(s.get(images.IMAGES_COLUMN, b"")) for s in samples]
        stripped = [{k: v for k, v in s.items() if k != images.IMAGES_COLUMN} for s in samples]
        batch = dict(self.collate(stripped))
        per_row = rows_images(per_sample, batch)
        batch["num_images"] = sum(len(refs) for refs in per_row)
        opened = [[images.open_image(ref) for ref in refs] for refs in per_row]
        batch.update(image_inputs(self.processor, opened))
        for prefix in _sample_row_sets(batch):  # rows of their own, one per sample (KTO's KL sequences)
            inputs = image_inputs(
                self.processor, [[images.open_image(r) for r in refs] for refs in per_sample]
            )
            batch.update({prefix + key: value for key, value in inputs.items()})
        return batch


def _sample_row_sets(batch: dict[str, Any]) -> list[str]:
    """The prefixes of a batch's other sets of rows (``kl_input_ids``: ``kl_``), one row per sample."""
    return [key.removesuffix("input_ids") for key in batch if key.endswith("_input_ids")]


def image_inputs(processor: Any, per_row: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The model's image inputs for rows holding these images (Pillow, each row's in order); none for rows
    without images."""
    if not any(per_row):
        return {}
    inputs = processor.image_processor(images=[list(row) for row in per_row], return_tensors="pt")
    return {key: inputs[key] for key in IMAGE_INPUTS if key in inputs}


def prompt_images(rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """Each prompt row's images (opened by ``data.prompts.decode_row``), empty for a row without."""
    return [list(row.get("images") or []) for row in rows]


def attach_images(
    micro_batches: list[dict[str, Any]], per_row: Sequence[Sequence[Any]], processor: Any
) -> list[dict[str, Any]]:
    """Online micro-batches (consecutive slices of the rows) given their rows' image inputs."""
    if processor is None or not any(per_row):
        return micro_batches
    start = 0
    for batch in micro_batches:
        rows = int(batch["input_ids"].shape[0])
        batch.update(image_inputs(processor, per_row[start : start + rows]))
        start += rows
    return micro_batches


def rows_images(per_sample: list[list[Any]], batch: dict[str, Any]) -> list[list[Any]]:
    """Each batch row's images: its sample's (``row_sample`` names a row's sample where a sample gives several
    rows, a preference pair's chosen and rejected), or all the samples' in one row (padding-free)."""
    rows = int(batch["input_ids"].shape[0])
    if "row_sample" in batch:
        return [per_sample[int(i)] for i in batch["row_sample"].tolist()]
    if rows == len(per_sample):
        return per_sample
    if rows == 1:  # the samples laid in one row (padding-free)
        return [[ref for refs in per_sample for ref in refs]]
    raise ValueError(
        f"{rows} batch rows for {len(per_sample)} samples: which row reads which images is unknown"
    )


def with_image_batches(collate: Any, tokenizer: Any) -> Any:
    """The run's collator, given image batches when the tokenizer carries a processor."""
    processor = processor_of(tokenizer)
    if processor is None or getattr(collate, "reads_images", False):  # prompts: their rows carry the images
        return collate
    return ImageBatches(collate, processor)
