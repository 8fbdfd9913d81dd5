"""Preference pairs -> token ids + labels for the chosen and the rejected answer.

Rows hold ``prompt``, ``chosen``, ``rejected`` (SiloGen: ``prompt_messages``, ``chosen_messages``,
``rejected_messages``; ERNIEKit: ``messages`` for the prompt, or its ``src``/``tgt``/``response``/``sort`` rows,
see ``row_formats``), each a message list or a plain string (a string prompt is one user message, a string
answer one assistant message). Labels are set only on the answer's assistant tokens, end-of-turn included,
never on assistant turns inside the prompt. A prompt longer than ``max_prompt_length`` tokens keeps its
first (``keep_start``) or last (``keep_end``) tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from posttrain.config.dpo import DPODataConfig
from posttrain.data.row_formats import erniekit_pair, is_erniekit, sharegpt_pair
from posttrain.data.samples import (
    IGNORE_INDEX,
    RowError,
    Sample,
    check_messages,
    keep_prompt_tokens,
    pad_rows,
    render_ids,
    trained_tokens,
)
from posttrain.data.sft import assistant_mask, check_turn_ends
from posttrain.data.store import VALUES_SUFFIX

Pair = dict[str, Any]
SIDES = ("chosen", "rejected")
#: TRL's score columns of a pair (ERNIEKit's ``sort`` values become them)
SCORE_KEYS = ("score_chosen", "score_rejected")
#: the stored column holding them: ``[score_chosen, score_rejected]``, or empty
SCORES = "scores_values"
#: a reward pair's ``margin`` (TRL's column; how much better the chosen answer is), or empty
MARGIN = "margin_values"


def token_columns(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """The ids and labels columns of each of a sample's sequences (``chosen_input_ids``...)."""
    return tuple(f"{prefix}_{column}" for prefix in prefixes for column in ("input_ids", "labels"))


#: a pair's token columns: both answers' ids and labels
PAIR_COLUMNS = token_columns(SIDES)


def field_of(row: dict[str, Any], name: str) -> Any:
    for key in (name, f"{name}_messages"):
        if key in row:
            return row[key]
    present = ", ".join(map(str, row)) or "none"
    raise RowError(f"missing {name!r} (or {name + '_messages'!r}); keys present: {present}")


def _messages(value: Any, role: str, name: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise RowError(f"{name!r} must be a string or a non-empty list of messages")
    return value


#: a conversation's check: the messages as they are rendered, or the row's ``RowError``
Check = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def _answer(
    tokenizer: Any,
    prompt: list[dict[str, Any]],
    answer: list[dict[str, Any]],
    name: str,
    check_end: bool,
    check: Check = check_messages,
) -> Sample:
    try:
        conversation = check(prompt + answer)
    except RowError as exc:
        raise RowError(f"prompt + {name}: {exc}") from None
    ids, mask = assistant_mask(tokenizer, conversation)
    prompt_len = len(render_ids(tokenizer, prompt)) if prompt else 0
    if ids[:prompt_len] != render_ids(tokenizer, prompt):
        raise RowError("the chat template does not render the prompt as a token prefix of prompt + answer")
    if check_end:
        try:
            check_turn_ends(tokenizer, ids, mask, start=prompt_len)
        except RowError as exc:
            raise RowError(f"{name}: {exc}") from None
    labels = [
        tok if keep and i >= prompt_len else IGNORE_INDEX
        for i, (tok, keep) in enumerate(zip(ids, mask, strict=True))
    ]
    if all(label == IGNORE_INDEX for label in labels):
        raise RowError(f"{name!r} has no assistant message, so there is nothing to compare")
    return {"input_ids": ids, "labels": labels, "prompt_len": [prompt_len]}


def _cut_prompt(sample: Sample, max_prompt_length: int, truncation: str) -> Sample:
    prompt_len = sample["prompt_len"][0]
    kept = keep_prompt_tokens(list(range(prompt_len)), max_prompt_length, truncation)  # the positions kept
    if len(kept) == prompt_len:
        return sample
    ids = [sample["input_ids"][i] for i in kept] + sample["input_ids"][prompt_len:]
    labels = [sample["labels"][i] for i in kept] + sample["labels"][prompt_len:]
    return {"input_ids": ids, "labels": labels, "prompt_len": [len(kept)]}


def pair_scores(row: dict[str, Any], required: bool) -> list[float]:
    """``[score_chosen, score_rejected]`` from TRL's columns (ERNIEKit's ``sort`` becomes them), or ``[]``."""
    present = [key for key in SCORE_KEYS if key in row]
    if not present:
        if required:
            raise RowError(
                "no scores: the loss reads each pair's score_chosen and score_rejected (offset_alpha > 0)"
            )
        return []
    if len(present) == 1:
        raise RowError(f"{present[0]!r} without {next(k for k in SCORE_KEYS if k not in present)!r}")
    scores = [row[key] for key in SCORE_KEYS]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in scores):
        raise RowError(f"score_chosen and score_rejected must be finite numbers, not {scores}")
    if required and scores[0] < scores[1]:
        raise RowError(
            f"score_chosen {scores[0]} is below score_rejected {scores[1]}: the score offset takes the log of "
            "their difference"
        )
    return [float(v) for v in scores]


def pair_row(row: dict[str, Any]) -> dict[str, Any]:
    """Any pair layout (TRL's, SiloGen's ``*_messages``, ERNIEKit's, LLaMA-Factory's) as ``prompt``/``chosen``/``rejected``."""
    if is_erniekit(row):
        return erniekit_pair(row)
    if "messages" in row and "prompt" not in row:  # ERNIEKit's chatml preference rows
        return {**row, "prompt": row["messages"]}
    if "conversations" in row and "prompt" not in row:  # LLaMA-Factory's ranked ShareGPT rows
        return sharegpt_pair(row)
    return row


def prompt_of(row: dict[str, Any]) -> list[dict[str, str]]:
    return _messages(field_of(row, "prompt"), "user", "prompt")


def render_completion(
    tokenizer: Any,
    prompt: list[dict[str, str]],
    value: Any,
    name: str,
    max_prompt_length: int = 0,
    truncation: str = "keep_end",
    check_end_of_turn: bool = True,
    check: Check = check_messages,
) -> Sample:
    """``prompt`` + the completion ``value`` (a string or assistant messages) as token ids, labels on the
    completion's assistant tokens, and ``prompt_len`` (the prompt cut to ``max_prompt_length``). ``check``:
    the conversation's check (messages with image parts are checked on their text)."""
    answer = _messages(value, "assistant", name)
    return _cut_prompt(
        _answer(tokenizer, prompt, answer, name, check_end_of_turn, check), max_prompt_length, truncation
    )


def format_pair(
    row: dict[str, Any],
    tokenizer: Any,
    max_prompt_length: int = 0,
    truncation: str = "keep_end",
    check_end_of_turn: bool = True,
    require_scores: bool = False,
) -> Sample:
    row = pair_row(row)
    prompt = prompt_of(row)
    out: Sample = {}
    for name in SIDES:
        sample = render_completion(
            tokenizer, prompt, field_of(row, name), name, max_prompt_length, truncation, check_end_of_turn
        )
        out[f"{name}_input_ids"] = sample["input_ids"]
        out[f"{name}_labels"] = sample["labels"]
    out[SCORES] = pair_scores(row, require_scores)
    return out


def format_dpo_row(row: dict[str, Any], tokenizer: Any, config: DPODataConfig) -> Pair:
    return format_pair(
        row,
        tokenizer,
        config.max_prompt_length,
        config.prompt_truncation,
        config.check_end_of_turn,
        config.require_scores,
    )


def fit_pair(pair: Pair, max_length: int, config: DPODataConfig) -> tuple[Pair | None, str, bool]:
    """Drop (or cut both sides of) a pair with a side longer than ``max_length``; drop a pair with an answer
    that has nothing to train."""
    truncated = False
    if any(len(pair[f"{side}_input_ids"]) > max_length for side in SIDES):
        if config.overlong_samples == "drop":
            return None, f"longer than max_length={max_length}", False
        pair = {
            key: value if key.endswith(VALUES_SUFFIX) else value[:max_length] for key, value in pair.items()
        }
        truncated = True
    if any(not trained_tokens(pair[f"{side}_labels"]) for side in SIDES):
        return None, "an answer has no trained tokens", truncated
    return pair, "", truncated


def score_delta(pair: Pair) -> float:
    """``score_chosen - score_rejected`` (NaN for a pair without scores)."""
    scores = pair.get(SCORES)
    return float(scores[0] - scores[1]) if scores is not None and len(scores) == 2 else math.nan


def margin(pair: Pair) -> float:
    """A reward pair's margin (0 without one)."""
    value = pair.get(MARGIN)
    return float(value[0]) if value is not None and len(value) else 0.0


def pair_margin(row: dict[str, Any]) -> list[float]:
    """``[margin]`` from TRL's ``margin`` column, or ``[]``."""
    if "margin" not in row or row["margin"] is None:
        return []
    value = row["margin"]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise RowError(f"'margin' must be a finite number, not {value!r}")
    return [float(value)]


class PairCollator:
    """B pairs -> one batch of 2B rows (the chosen answers, then the rejected ones), padded together. dpo's and
    reward's ``collator`` hook (``registry.CollatorBuilder``: the class, built from the pad id)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, pairs: list[Pair]) -> dict[str, Any]:
        rows = [(p[f"{side}_input_ids"], p[f"{side}_labels"]) for side in SIDES for p in pairs]
        input_ids, labels, attention = pad_rows(rows, self.pad_id)
        # padding pairs (eval shards) carry no labels and so no weight
        weights = [float(np.any(np.asarray(p["chosen_labels"]) != IGNORE_INDEX)) for p in pairs]
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention,
            "ref_chosen": torch.tensor([p.get("ref_chosen", 0.0) for p in pairs], dtype=torch.float64),
            "ref_rejected": torch.tensor([p.get("ref_rejected", 0.0) for p in pairs], dtype=torch.float64),
            "pair_weight": torch.tensor(weights, dtype=torch.float64),
            "row_sample": torch.arange(len(pairs)).repeat(len(SIDES)),  # each row's pair
            "score_delta": torch.tensor([score_delta(p) for p in pairs], dtype=torch.float64),
            "margin": torch.tensor([margin(p) for p in pairs], dtype=torch.float64),
            "num_loss_units": int(sum(weights)),
            "num_chosen_tokens": trained_tokens(labels[: len(pairs)]),
            "num_target_tokens": trained_tokens(labels),
            "num_input_tokens": sum(len(ids) for ids, _ in rows),
            "num_samples": len(pairs),
            "num_attention_sq": sum(len(ids) ** 2 for ids, _ in rows),
        }
