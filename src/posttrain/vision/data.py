"""A method's data stages with images in mind: in a vision-language run, the method's own formatter where it
reads images (SFT), a refusal per row where it does not yet, and a length policy that never cuts a row with
images (its image tokens would be split from their pixels); in a text model's run, a refusal per row with
images. A row's images are never silently dropped."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from posttrain.config.data import DataConfig
from posttrain.data.samples import RowError, Sample
from posttrain.vision import images
from posttrain.vision.formatting import ORIGIN, format_image_rows
from posttrain.vision.preferences import (
    PROMPT_LENGTH,
    fit_image_kto,
    fit_image_pair,
    format_image_kto_rows,
    format_image_pairs,
)
from posttrain.vision.processor import feature_token_id, processor_of
from posttrain.vision.prompts import fit_image_prompt, format_image_prompts


@dataclass(frozen=True)
class ImageData:
    """A method's data stages for rows with images."""

    format_batch: Callable[..., list[Any]]
    fit: Callable[..., tuple[Sample | None, str, bool]] | None = None
    """The length rule; None: the method's own, a sample with images never cut."""
    columns: tuple[str, ...] = ()
    """Columns the formatter adds to the method's (besides the image references)."""


#: the data types whose rows may hold images, and their stages
IMAGE_DATA = {
    "sft": ImageData(format_image_rows),
    "dpo": ImageData(format_image_pairs, fit_image_pair, (PROMPT_LENGTH,)),
    "kto": ImageData(format_image_kto_rows, fit_image_kto, (PROMPT_LENGTH,)),
    "prompts": ImageData(format_image_prompts, fit_image_prompt),
}


def with_images(factory: Any, data_type: str, tokenizer: Any) -> Any:
    """``factory`` (a ``data.build.DataFactory``) for this run: reading images when the tokenizer carries a
    processor (a vision-language model), refusing rows with images when it does not."""
    if processor_of(tokenizer) is None:  # a text model: a row's images are refused, never dropped
        why = "the model is a text model (no image processor): train images with a vision-language model"
        return replace(factory, format_batch=_refusing(factory.format_batch, why))
    stages = IMAGE_DATA.get(data_type)
    if stages is None:
        readers = ", ".join(IMAGE_DATA)
        why = (
            f"images train with types {readers} so far ({data_type} on images is not supported yet); remove "
            f"the images or train with {readers}"
        )
        return replace(factory, format_batch=_refusing(factory.format_batch, why))
    token_id = feature_token_id(processor_of(tokenizer))

    def measure(sample: Sample) -> tuple[int, int]:
        """The sample's images and the image tokens of all its sequences (a pair's twice: both rows read them)."""
        tokens = sum(int((sample[key] == token_id).sum()) for key in _token_columns(sample))
        return len(images.decode(sample[images.IMAGES_COLUMN])), tokens

    return replace(
        factory,
        measure=measure,
        format_batch=stages.format_batch,
        columns=(*factory.columns, *stages.columns, images.IMAGES_COLUMN),
        fit=stages.fit or _fit_with_images(factory.fit),
        origin_key=ORIGIN,
        revision=factory.revision * 1000 + 1,
    )


def _refusing(format_batch: Any, why: str) -> Any:
    """``format_batch`` for the rows without images; each row with images is its error (``why``)."""

    def format_text_rows(rows: list[dict[str, Any]], tokenizer: Any, config: DataConfig) -> list[Any]:
        text = [i for i, row in enumerate(rows) if not images.row_has_images(row)]
        formatted = iter(format_batch([rows[i] for i in text], tokenizer, config))
        refusal = RowError(f"a row with images: {why}")
        kept = set(text)
        return [next(formatted) if i in kept else refusal for i in range(len(rows))]

    return format_text_rows


def _fit_with_images(fit: Any) -> Any:
    def fit_sample(sample: Sample, max_length: int, config: DataConfig) -> tuple[Sample | None, str, bool]:
        stored = sample[images.IMAGES_COLUMN]
        longest = max(len(sample[key]) for key in _token_columns(sample))
        if longest > max_length and images.decode(stored):
            return (
                None,
                f"longer than max_length={max_length}; rows with images are dropped, never cut",
                False,
            )
        tokens = {k: v for k, v in sample.items() if k != images.IMAGES_COLUMN}
        kept, reason, cut = fit(tokens, max_length, config)
        if kept is not None:
            kept = {**kept, images.IMAGES_COLUMN: np.asarray(stored)}
        return kept, reason, cut

    return fit_sample


def _token_columns(sample: Sample) -> list[str]:
    """The sample's sequences' ids columns (``input_ids``; a pair's ``chosen_input_ids``...)."""
    return [key for key in sample if key.endswith("input_ids")]
