"""Preference pairs (and KTO's completions) whose prompt holds images (TRL's ``prompt``/``chosen``/``rejected``
+ ``images``; ``prompt``/``completion``/``label`` + ``images``).

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
from posttrain.config.kto import KTODataConfig
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
from posttrain.data.kto import answers_of, fit_kto, format_kto_batch
from posttrain.data.samples import RowError, Sample, trained_tokens
from posttrain.data.store import loop_format
from posttrain.vision import images
from posttrain.vision.formatting import ORIGIN, checked_parts, expand_labelled, images_of
from posttrain.vision.processor import processor_of

#: an image pair's prompt length in tokens (its images expanded), for the length rule
PROMPT_LENGTH = "prompt_length_values"


def image_completion(
    tokenizer: Any, prompt: list[dict[str, Any]], opened: list[Any], value: Any, name: str, check_end: bool
) -> Sample:
    """``prompt`` (messages with image parts, its images ``opened``) + the completion ``value``: the expanded
    ids, labels on the completion's assistant tokens, and ``prompt_len`` (expanded)."""
    answer, found = images.parts_of(
        [{"role": "assistant", "content": value}] if isinstance(value, str) else value, []
    )
    if found:
        raise RowError(f"{name!r} holds an image; the images go in the prompt")
    sample = render_completion(
        tokenizer, prompt, answer, name, check_end_of_turn=check_end, check=checked_parts
    )
    ids, labels = expand_labelled(
        processor_of(tokenizer), tokenizer, prompt + answer, opened, sample["input_ids"], sample["labels"]
    )
    prompt_len = sample["prompt_len"][0] + len(ids) - len(sample["input_ids"])  # the images are the prompt's
    return {"input_ids": ids, "labels": labels, "prompt_len": [prompt_len]}


def format_image_pair(row: dict[str, Any], tokenizer: Any, config: DPODataConfig) -> Pair:
    """One preference row of a vision-language run -> both answers' expanded ids and labels, the scores, the
    prompt's image references and its length."""
    pair = pair_row({k: v for k, v in row.items() if k != ORIGIN})
    prompt, refs, opened = images_of(row, prompt_of(pair))
    out: Pair = {}
    for name in SIDES:
        sample = image_completion(
            tokenizer, prompt, opened, field_of(pair, name), name, config.check_end_of_turn
        )
        out[f"{name}_input_ids"], out[f"{name}_labels"] = sample["input_ids"], sample["labels"]
    out[SCORES] = pair_scores(pair, config.require_scores)
    out[PROMPT_LENGTH] = sample["prompt_len"]
    out[images.IMAGES_COLUMN] = images.encode(refs)
    return out


#: dpo's batch formatter in a vision-language run: each row's pair or its error
format_image_pairs = loop_format(format_image_pair)


def image_kto_completions(row: dict[str, Any], tokenizer: Any, config: KTODataConfig) -> dict[str, Sample]:
    """KTO's completions of a row whose prompt holds images (``data.kto.Completer``), each carrying the
    prompt's image references and length to its sample."""
    prompt_row, answers = answers_of({k: v for k, v in row.items() if k != ORIGIN})
    prompt, refs, opened = images_of(row, prompt_of(prompt_row))
    out = {}
    for kind, (value, name) in answers.items():
        sample = image_completion(tokenizer, prompt, opened, value, name, config.check_end_of_turn)
        out[kind] = {**sample, PROMPT_LENGTH: sample["prompt_len"], images.IMAGES_COLUMN: images.encode(refs)}
    return out


def format_image_kto_rows(rows: list[dict[str, Any]], tokenizer: Any, config: KTODataConfig) -> list[Any]:
    """kto's batch formatter in a vision-language run (its KL sequences paired as for text)."""
    return format_kto_batch(rows, tokenizer, config, image_kto_completions)


def fit_image_kto(sample: Sample, max_length: int, config: KTODataConfig) -> tuple[Sample | None, str, bool]:
    """Keep a KTO sample whose sequences fit ``max_length`` and whose prompt fits ``max_prompt_length``; drop
    the rest (rows with images are never cut)."""
    if any(len(value) > max_length for key, value in sample.items() if key.endswith("input_ids")):
        return None, f"longer than max_length={max_length}; rows with images are dropped, never cut", False
    dropped = _long_prompt(sample, config.max_prompt_length)
    if dropped:
        return None, dropped, False
    tokens = {k: v for k, v in sample.items() if k not in (PROMPT_LENGTH, images.IMAGES_COLUMN)}
    kept, reason, cut = fit_kto(tokens, max_length, config)
    return (None if kept is None else sample), reason, cut


def _long_prompt(sample: Sample, max_prompt_length: int) -> str:
    """Why a sample whose prompt is over ``max_prompt_length`` is dropped ("" when it is not)."""
    length = int(np.asarray(sample[PROMPT_LENGTH])[0])
    if 0 < max_prompt_length < length:
        return f"prompt longer than max_prompt_length={max_prompt_length}; prompts with images are dropped, never cut"
    return ""


def fit_image_pair(pair: Pair, max_length: int, config: DPODataConfig) -> tuple[Pair | None, str, bool]:
    """Keep a pair whose rows fit ``max_length`` and whose prompt fits ``max_prompt_length``; drop the rest
    (rows with images are never cut)."""
    if any(len(pair[f"{side}_input_ids"]) > max_length for side in SIDES):
        return None, f"longer than max_length={max_length}; rows with images are dropped, never cut", False
    dropped = _long_prompt(pair, config.max_prompt_length)
    if dropped:
        return None, dropped, False
    if any(not trained_tokens(pair[f"{side}_labels"]) for side in SIDES):
        return None, "an answer has no trained tokens", False
    return pair, "", False
