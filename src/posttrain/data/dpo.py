"""Preference pairs -> token ids + labels for the chosen and the rejected answer.

Rows hold ``prompt``, ``chosen``, ``rejected`` (SiloGen: ``prompt_messages``, ``chosen_messages``,
``rejected_messages``), each a message list or a plain string (a string prompt is one user message, a string
answer one assistant message). Labels are set only on the answer's assistant tokens, end-of-turn included,
never on assistant turns inside the prompt. A prompt longer than ``max_prompt_length`` tokens keeps its
first (``keep_start``) or last (``keep_end``) tokens.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.sft import (
    IGNORE_INDEX,
    RowError,
    _render_ids,
    assistant_mask,
    check_messages,
    check_turn_ends,
)

Sample = dict[str, list[int]]


def _field(row: dict[str, Any], name: str) -> Any:
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


def _answer(
    tokenizer: Any, prompt: list[dict[str, str]], answer: list[dict[str, str]], name: str, check_end: bool
) -> Sample:
    try:
        conversation = check_messages({"messages": prompt + answer})
    except RowError as exc:
        raise RowError(f"prompt + {name}: {exc}") from None
    ids, mask = assistant_mask(tokenizer, conversation)
    prompt_len = len(_render_ids(tokenizer, prompt)) if prompt else 0
    if ids[:prompt_len] != _render_ids(tokenizer, prompt):
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
    if not max_prompt_length or prompt_len <= max_prompt_length:
        return sample
    if truncation == "keep_start":
        keep = slice(0, max_prompt_length)
    else:
        keep = slice(prompt_len - max_prompt_length, prompt_len)
    ids = sample["input_ids"][keep] + sample["input_ids"][prompt_len:]
    labels = sample["labels"][keep] + sample["labels"][prompt_len:]
    return {"input_ids": ids, "labels": labels, "prompt_len": [max_prompt_length]}


def format_pair(
    row: dict[str, Any],
    tokenizer: Any,
    max_prompt_length: int = 0,
    truncation: str = "keep_end",
    check_end_of_turn: bool = True,
) -> Sample:
    prompt = _messages(_field(row, "prompt"), "user", "prompt")
    out: Sample = {}
    for name in ("chosen", "rejected"):
        answer = _messages(_field(row, name), "assistant", name)
        full = _answer(tokenizer, prompt, answer, name, check_end_of_turn)
        sample = _cut_prompt(full, max_prompt_length, truncation)
        out[f"{name}_input_ids"] = sample["input_ids"]
        out[f"{name}_labels"] = sample["labels"]
    return out
