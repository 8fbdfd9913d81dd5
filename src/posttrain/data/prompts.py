"""The prompts an online method samples from (``data.type: prompts``; grpo's and distill's): token ids of the
prompt, rendered as the model will continue it, and the row itself, which the reward functions read.

A row holds ``prompt`` (TRL's layout: a list of messages, rendered with the chat template and its generation
prompt; or plain text, tokenized as it is, no special tokens added, as TRL does), or ``messages`` ending
with a user turn. Every other column is handed to the reward functions (``answer`` for ``exact_match``...).
The row is stored beside the tokens as UTF-8 JSON (the store's ``row_json`` byte column) with the place it
came from (under ``ORIGIN_KEY``), so a reward that fails names the file and row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from posttrain.config.prompts import PromptsDataConfig
from posttrain.data.samples import RowError, Sample, check_messages_shape, keep_prompt_tokens, render_ids
from posttrain.data.views import PADDING

#: the store column holding each prompt row as UTF-8 JSON
ROW_COLUMN = "row_json"
COLUMNS = ("input_ids", ROW_COLUMN)
#: where a stored row keeps the place it came from (``file row N``), for a reward's error
ORIGIN_KEY = "__origin__"
#: the row's keys that are not columns for the reward functions
PROMPT_KEYS = ("prompt", "messages", ORIGIN_KEY)


def prompt_of(row: dict[str, Any]) -> list[dict[str, Any]] | str:
    """The prompt of a row, checked: a list of messages ending with a user (or tool) turn, or text."""
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise RowError("'prompt' is empty")
            return prompt
    elif "messages" in row:
        prompt = row["messages"]
    else:
        keys = ", ".join(map(str, row)) or "none"
        raise RowError(
            f"no prompt (keys: {keys}); grpo reads 'prompt' (a list of messages or text) or 'messages' ending "
            "with a user turn; other column names: data.sources[].columns (e.g. {prompt: question})"
        )
    messages = (
        [_with_images(*pair) for pair in zip(prompt, check_messages_shape(_text_view(prompt)), strict=True)]
        if isinstance(prompt, list)
        else check_messages_shape(prompt)
    )
    if messages[-1]["role"] == "assistant":
        raise RowError(
            "the conversation ends with an assistant turn: grpo samples that answer itself; end the prompt "
            "with the user's turn (the assistant turn can be a column for a reward, e.g. 'answer')"
        )
    return messages


def _text_view(messages: list[Any]) -> list[Any]:
    """Messages whose content is a list of parts (TRL's ``{"type": "text"}`` and image parts) with their text
    joined, for the checks; other messages as they are."""
    return [
        {**m, "content": "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))}
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        else m
        for m in messages
    ]


def _with_images(given: Any, checked: dict[str, Any]) -> dict[str, Any]:
    """A checked message, keeping the given parts when they hold an image (a vision-language model's prompt,
    rendered with its processor's template); text parts alone are joined."""
    content = given.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
        return {**checked, "content": content}
    return checked


def prompt_ids(
    tokenizer: Any, prompt: list[dict[str, Any]] | str, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Messages through the chat template with its generation prompt (and the tools' schemas); text with the
    tokenizer's special tokens (its BOS, for tokenizers that add one), as TRL tokenizes a text prompt."""
    if isinstance(prompt, str):
        if tools is not None:  # a run with tools or environments
            raise RowError("a text prompt with tools: tools need chat prompts (a list of messages)")
        return list(tokenizer(prompt)["input_ids"])
    return render_ids(tokenizer, prompt, add_generation_prompt=True, tools=tools)


def row_tools(row: dict[str, Any], schemas: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]] | None:
    """The tools' schemas a row's prompt is rendered with (its ``environment``'s, when several)."""
    if not schemas:
        return None
    if "" in schemas:
        return schemas[""]
    name = row.get("environment")
    if name not in schemas:
        raise RowError(
            f"environment {name!r} is not one of environment_factory's ({', '.join(schemas)}); every row names "
            "its environment in an 'environment' column"
        )
    return schemas[name]


def format_prompt_rows(rows: list[dict[str, Any]], tokenizer: Any, config: PromptsDataConfig) -> list[Any]:
    out: list[Any] = []
    for row in rows:
        try:
            ids = prompt_ids(tokenizer, prompt_of(row), row_tools(row, config.tool_schemas))
            out.append(
                prompt_sample(
                    row, keep_prompt_tokens(ids, config.max_prompt_length, config.prompt_truncation), config
                )
            )
        except RowError as exc:
            out.append(exc)
    return out


def prompt_sample(row: dict[str, Any], ids: Sequence[int], config: PromptsDataConfig) -> Sample:
    """A prompt's stored sample: its token ids and the row (for the rewards), which must hold the columns
    the rewards read (``data.reward_columns``)."""
    missing = [c for c in config.reward_columns if c not in row]
    if missing:
        present = ", ".join(k for k in row if k != ORIGIN_KEY)
        raise RowError(
            f"no column {', '.join(map(repr, missing))} for the rewards (data.reward_columns; present: "
            f"{present}); map another name with data.sources[].columns"
        )
    encoded = json.dumps(row, ensure_ascii=False, default=str).encode()
    return {"input_ids": np.asarray(ids, dtype=np.int64), ROW_COLUMN: np.frombuffer(encoded, np.uint8)}


def fit_prompt(sample: Sample, max_length: int, config: PromptsDataConfig) -> tuple[Sample | None, str, bool]:
    """A prompt longer than ``max_length`` is dropped, or (``overlong_samples: truncate``) keeps the part
    ``prompt_truncation`` says."""
    ids = sample["input_ids"]
    if len(ids) <= max_length:
        return sample, "", False
    if config.overlong_samples == "drop":
        return None, f"prompt longer than max_length={max_length}", False
    kept = keep_prompt_tokens(list(ids), max_length, config.prompt_truncation)
    return {**sample, "input_ids": np.asarray(kept, dtype=np.int64)}, "", True


def decode_row(item: dict[str, Any]) -> dict[str, Any]:
    """The stored row of a sample item, with its images opened (Pillow, in order) under ``images`` where the
    prompt holds some (a vision-language run): what the rewards receive, as TRL gives them."""
    from posttrain.vision.images import IMAGES_COLUMN, decode, open_image

    row = json.loads(bytes(np.asarray(item[ROW_COLUMN], dtype=np.uint8)).decode())
    refs = decode(item[IMAGES_COLUMN]) if IMAGES_COLUMN in item else []
    if refs:
        row = {key: value for key, value in row.items() if key != "image"}
        row["images"] = [open_image(ref) for ref in refs]
    return row


def reward_columns(row: dict[str, Any]) -> dict[str, Any]:
    """The row's columns for the reward functions: everything but the prompt."""
    return {key: value for key, value in row.items() if key not in PROMPT_KEYS}


class PromptCollator:
    """Prompts -> a left-padded batch for generation (evaluation), with the rows for the rewards. grpo's
    ``collator`` hook (``registry.CollatorBuilder``: the class, built from the pad id). A prompt's images
    travel with its row (``decode_row``), to generation and the rewards."""

    reads_images = True

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        ids = [np.asarray(item["input_ids"]) for item in items]
        longest = max(len(x) for x in ids)
        batch = torch.full((len(ids), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for index, row in enumerate(ids):
            batch[index, longest - len(row) :] = torch.as_tensor(row)
            mask[index, longest - len(row) :] = 1
        rows = [decode_row(item) for item in items]
        weights = [0.0 if item.get(PADDING) else 1.0 for item in items]  # an eval shard's filler counts 0
        return {
            "prompt_ids": batch,
            "prompt_mask": mask,
            "prompt_weight": torch.tensor(weights, dtype=torch.float64),
            "rows": rows,
            "num_loss_units": int(sum(weights)),
            "num_target_tokens": 0,
            "num_input_tokens": int(mask.sum()),
            "num_samples": len(items),
            "num_attention_sq": sum(len(x) ** 2 for x in ids),
        }
