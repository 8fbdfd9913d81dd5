"""Prompts with images for the online methods (TRL's GRPO rows: ``prompt`` messages with image parts or
``<image>`` placeholders, and ``images``).

A prompt is rendered with the chat template and its generation prompt, one image token per image, and the
processor expands each (checked against its own call on the whole prompt): those ids are what generation
continues and what the trainer scores, and the images go with them to both. The row is kept for the rewards,
which receive its images opened (``images``, TRL's column). A prompt with images is never cut: one over
``max_prompt_length`` or ``max_length`` is dropped and counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from posttrain.config.prompts import PromptsDataConfig
from posttrain.data.prompts import fit_prompt, prompt_ids, prompt_of, prompt_sample, row_tools
from posttrain.data.samples import IGNORE_INDEX, RowError, Sample, keep_prompt_tokens, render_ids
from posttrain.data.store import loop_format
from posttrain.vision import images
from posttrain.vision.formatting import images_of, processor_labelled
from posttrain.vision.processor import processor_of


def format_image_prompt(row: dict[str, Any], tokenizer: Any, config: PromptsDataConfig) -> Sample:
    """One prompt row of a vision-language run -> its expanded ids, the row and its image references."""
    prompt = prompt_of(row)
    tools = row_tools(row, config.tool_schemas)
    if not images.row_has_images(row):
        if isinstance(prompt, str):
            ids = prompt_ids(tokenizer, prompt, tools)
        else:  # the processor's template reads content parts
            parts = images.parts_of(prompt, [])[0]
            ids = render_ids(tokenizer, parts, add_generation_prompt=True, tools=tools)
        ids = keep_prompt_tokens(ids, config.max_prompt_length, config.prompt_truncation)
        return {**prompt_sample(row, ids, config), images.IMAGES_COLUMN: images.encode([])}
    if isinstance(prompt, str):
        raise RowError("a text prompt with images: give the prompt as messages (a list with image parts)")
    if tools is not None:
        raise RowError("a prompt with images in a run with tools: tools with images are not supported yet")
    processor = processor_of(tokenizer)
    messages, refs, opened = images_of(row, prompt)
    ids = render_ids(tokenizer, messages, add_generation_prompt=True)
    unlabelled = np.full(len(ids), IGNORE_INDEX)
    fitted = processor_labelled(
        processor, tokenizer, messages, opened, ids, unlabelled, add_generation_prompt=True
    )
    if fitted is None:
        raise RowError(
            "the processor's tokens for this prompt differ from its expansion of each image in place, so the "
            "trainer and the engine would not see the same prompt"
        )
    return {**prompt_sample(row, fitted[0], config), images.IMAGES_COLUMN: images.encode(refs)}


#: the prompts' batch formatter in a vision-language run: each row's sample or its error
format_image_prompts = loop_format(format_image_prompt)


def fit_image_prompt(
    sample: Sample, max_length: int, config: PromptsDataConfig
) -> tuple[Sample | None, str, bool]:
    """A prompt with images over ``max_length`` or ``max_prompt_length`` is dropped (never cut); the others
    follow the prompts' rule."""
    length = len(sample["input_ids"])
    if images.decode(sample[images.IMAGES_COLUMN]):
        if length > max_length:
            return (
                None,
                f"prompt longer than max_length={max_length}; prompts with images are never cut",
                False,
            )
        if 0 < config.max_prompt_length < length:
            return (
                None,
                f"prompt longer than max_prompt_length={config.max_prompt_length}; prompts with images are "
                "dropped, never cut",
                False,
            )
    return fit_prompt(sample, max_length, config)
