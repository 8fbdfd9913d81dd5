"""SFT formatting: a chat row -> token ids + labels that are set only on what the assistant says.

Labels come from token ids, never from searching text: with a template that marks assistant turns
(``{% generation %}``), from the template's own assistant mask; otherwise from token-exact prefix rendering
(the conversation rendered up to each assistant turn must be a token prefix of the whole). Either way the
end-of-turn token that closes each assistant turn is trained, so the model learns to stop.
"""

from __future__ import annotations

import re
from typing import Any

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RowError(ValueError):
    """A row that cannot be formatted; the caller adds the file and row number."""


def check_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    messages = row.get("messages")
    if messages is None:
        raise RowError(f"missing 'messages' (keys present: {', '.join(map(str, row)) or 'none'})")
    if not isinstance(messages, list) or not messages:
        raise RowError("'messages' must be a non-empty list of {role, content} objects")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RowError(f"messages[{index}] must be an object with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise RowError(f"messages[{index}].role {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise RowError(f"messages[{index}].content must be a string")
        clean.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in clean):
        raise RowError("the conversation has no assistant message, so nothing would be trained")
    return clean


def has_generation_markers(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return bool(_GENERATION_TAG.search(template if isinstance(template, str) else str(template)))


def _render_ids(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
        )["input_ids"]
    )


def assistant_mask(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(input_ids, mask) with mask 1 on assistant tokens, end-of-turn token included."""
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
    ids = _render_ids(tokenizer, messages)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_ids(tokenizer, messages[:index], add_generation_prompt=True)
        through = _render_ids(tokenizer, messages[: index + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise RowError(
                "the chat template does not render conversation prefixes as token prefixes, so assistant "
                "tokens cannot be located exactly; use a template with {% generation %} markers"
            )
        for position in range(len(before), len(through)):
            mask[position] = 1
    return ids, mask


def format_sft(row: dict[str, Any], tokenizer: Any, mask_inputs: bool = True) -> dict[str, list[int]]:
    messages = check_messages(row)
    ids, mask = assistant_mask(tokenizer, messages)
    if mask_inputs:
        labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask, strict=True)]
    else:
        labels = list(ids)
    return {"input_ids": ids, "labels": labels}
