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


def check_turn_ends(tokenizer: Any, ids: list[int], mask: list[int], start: int = 0) -> None:
    """Every assistant turn (a run of mask 1) that ends at or after ``start`` must end with an end-of-turn
    token (EOS, ``<|im_end|>``, ``<|eot_id|>``...; whitespace after it is allowed), or the model never
    learns to stop."""
    from posttrain.tokenizers.chat_templates import end_of_turn_ids

    allowed = end_of_turn_ids(tokenizer)
    turn = 0
    for end, keep in enumerate(mask):
        if not keep or (end + 1 < len(mask) and mask[end + 1]):
            continue
        turn += 1
        position = end  # the prefix method also trains whitespace after the end-of-turn token
        while position > 0 and mask[position - 1] and not tokenizer.decode([ids[position]]).strip():
            position -= 1
        if end >= start and ids[position] not in allowed:
            shown = tokenizer.convert_ids_to_tokens(ids[position])
            raise RowError(
                f"assistant turn {turn} ends with {shown!r} (id {ids[position]}), not an end-of-turn token, so "
                "the model would never learn to stop; put the end-of-turn token inside the template's "
                "{% generation %} block (or set data.check_end_of_turn: false)"
            )


def format_sft(
    row: dict[str, Any], tokenizer: Any, mask_inputs: bool = True, check_end_of_turn: bool = True
) -> dict[str, list[int]]:
    messages = check_messages(row)
    ids, mask = assistant_mask(tokenizer, messages)
    if check_end_of_turn:
        check_turn_ends(tokenizer, ids, mask)
    if mask_inputs:
        labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask, strict=True)]
    else:
        labels = list(ids)
    return {"input_ids": ids, "labels": labels}
