"""Preference pairs whose prompt holds images (TRL's ``prompt``/``chosen``/``rejected`` + ``images``).

Each answer is rendered after the prompt as for text (labels on the answer's assistant tokens only), then the
processor expands the prompt's images in both sequences, checked against its own call on the whole row. The
images belong to the prompt: an answer holding one is the row's error. A pair's images are stored once and
given to both of its rows. A prompt with images is never cut: a pair over ``max_length`` or with a prompt over
``max_prompt_length`` is dropped and counted, as the rules for image rows say.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from posttrain.config.dpo import DPODataConfig
from posttrain.data.dpo import (
    SCORES,
    SIDES,
    Pair,
    field_of,
    pair_row,
    pair_scores,
    prompt_of,
    render_completion,
)
from posttrain.data.samples import RowError, trained_tokens
from posttrain.vision import images
from posttrain.vision.formatting import ORIGIN, checked_parts, expand_labelled, images_of
from posttrain.vision.processor import processor_of

#: an image pair's prompt length in tokens (its images expanded), for the length rule
PROMPT_LENGTH = "prompt_length_values"


def format_image_pair(row: dict[str, Any], tokenizer: Any, config: DPODataConfig) -> Pair:
    """One preference row of a vision-language run -> both answers' expanded ids and labels, the scores, the
    prompt's image references and its length."""
    processor = processor_of(tokenizer)
    pair = pair_row({k: v for k, v in row.items() if k != ORIGIN})
    prompt, refs, opened = images_of(row, prompt_of(pair))
    out: Pair = {}
    for name in SIDES:
        value = field_of(pair, name)
        answer, found = images.parts_of(
            [{"role": "assistant", "content": value}] if isinstance(value, str) else value, []
        )
        if found:
            raise RowError(f"{name!r} holds an image; a pair's images go in its prompt")
        sample = render_completion(
            tokenizer, prompt, answer, name, check_end_of_turn=config.check_end_of_turn, check=checked_parts
        )
        ids, labels = expand_labelled(
            processor, tokenizer, prompt + answer, opened, sample["input_ids"], sample["labels"]
        )
        out[f"{name}_input_ids"], out[f"{name}_labels"] = ids, labels
        prompt_length = sample["prompt_len"][0] + len(ids) - len(sample["input_ids"])
    out[SCORES] = pair_scores(pair, config.require_scores)
    out[PROMPT_LENGTH] = [prompt_length]
    out[images.IMAGES_COLUMN] = images.encode(refs)
    return out


def format_image_pairs(rows: list[dict[str, Any]], tokenizer: Any, config: DPODataConfig) -> list[Any]:
    """dpo's batch formatter in a vision-language run: each row's pair or its error."""
    out: list[Any] = []
    for row in rows:
        try:
            out.append(format_image_pair(row, tokenizer, config))
        except RowError as error:
            out.append(error)
    return out


def fit_image_pair(pair: Pair, max_length: int, config: DPODataConfig) -> tuple[Pair | None, str, bool]:
    """Keep a pair whose rows fit ``max_length`` and whose prompt fits ``max_prompt_length``; drop the rest
    (rows with images are never cut)."""
    if any(len(pair[f"{side}_input_ids"]) > max_length for side in SIDES):
        return None, f"longer than max_length={max_length}; rows with images are dropped, never cut", False
    prompt_length = int(np.asarray(pair[PROMPT_LENGTH])[0])
    if 0 < config.max_prompt_length < prompt_length:
        return (
            None,
            f"prompt longer than max_prompt_length={config.max_prompt_length}; prompts with images are "
            "dropped, never cut",
            False,
        )
    if any(not trained_tokens(pair[f"{side}_labels"]) for side in SIDES):
        return None, "an answer has no trained tokens", False
    return pair, "", False
