"""SFT formatting: a chat row -> token ids + labels that are set only on what the assistant says.

Labels come from token ids, never from searching text: with a template that marks assistant turns
(``{% generation %}``), from the template's own assistant mask; otherwise from token-exact prefix rendering
(the conversation rendered up to each assistant turn must be a token prefix of the whole). Either way the
end-of-turn token that closes each assistant turn is trained, so the model learns to stop.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from posttrain.config.data import SFTDataConfig
from posttrain.data.row_formats import chat_messages
from posttrain.data.samples import (
    IGNORE_INDEX,
    RowError,
    check_messages,
    has_generation_markers,
    render_ids,
    render_with_spans,
)
from posttrain.errors import UserError
from posttrain.tokenizers.chat_templates import check_tools_rendered


def drop_context_turns(mask: np.ndarray, messages: list[dict[str, Any]]) -> np.ndarray:
    """Unmark the assistant turns written with ``train: false``: the k-th run of the mask is the k-th
    assistant message."""
    flags = [m.get("train", True) for m in messages if m["role"] == "assistant"]
    if all(flags):
        return mask
    mask = np.asarray(mask, dtype=bool).copy()
    starts, ends = turn_starts(mask), turn_ends(mask)
    if len(starts) != len(flags):
        raise RowError(
            f"{len(flags)} assistant messages but {len(starts)} assistant spans in the rendered text, so the "
            "turns marked train: false cannot be located"
        )
    for start, end, train in zip(starts, ends, flags, strict=True):
        if not train:
            mask[start : end + 1] = False
    return mask


def assistant_mask(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(input_ids, mask) with mask 1 on assistant tokens, end-of-turn token included."""
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
    ids = render_ids(tokenizer, messages)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_ids(tokenizer, messages[:index], add_generation_prompt=True)
        through = render_ids(tokenizer, messages[: index + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise RowError(
                "the chat template does not render conversation prefixes as token prefixes, so assistant "
                "tokens cannot be located exactly; use a template with {% generation %} markers"
            )
        for position in range(len(before), len(through)):
            mask[position] = 1
    return ids, mask


def turn_ends(mask: Any) -> np.ndarray:
    """Positions where a run of mask 1 (an assistant turn) ends."""
    mask = np.asarray(mask, dtype=bool)
    following = np.append(mask[1:], False)
    return np.flatnonzero(mask & ~following)


def turn_starts(mask: Any) -> np.ndarray:
    """Positions where a run of mask 1 (an assistant turn) starts."""
    mask = np.asarray(mask, dtype=bool)
    preceding = np.insert(mask[:-1], 0, False)
    return np.flatnonzero(mask & ~preceding)


def check_turn_ends(tokenizer: Any, ids: Any, mask: Any, start: int = 0) -> None:
    """Every assistant turn (a run of mask 1) that ends at or after ``start`` must end with an end-of-turn
    token (EOS, ``<|im_end|>``, ``<|eot_id|>``...; whitespace after it is allowed), or the model never
    learns to stop."""
    from posttrain.tokenizers.chat_templates import end_of_turn_ids

    allowed = end_of_turn_ids(tokenizer)
    for turn, end in enumerate(turn_ends(mask).tolist(), start=1):
        position = end  # the prefix method also trains whitespace after the end-of-turn token
        while position > 0 and mask[position - 1] and not tokenizer.decode([int(ids[position])]).strip():
            position -= 1
        if end >= start and int(ids[position]) not in allowed:
            shown = tokenizer.convert_ids_to_tokens(int(ids[position]))
            raise RowError(
                f"assistant turn {turn} ends with {shown!r} (id {ids[position]}), not an end-of-turn token, so "
                "the model would never learn to stop; put the end-of-turn token inside the template's "
                "{% generation %} block (or set data.check_end_of_turn: false)"
            )


def _span_mask(encoding: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    """The assistant mask from character spans, as ``apply_chat_template`` computes it: from the token holding
    a span's first character through the token holding its last (to the end when that one is missing); a
    span whose first character no token holds ends the marking. Only the span ends are looked up."""
    count = len(encoding)
    mask = np.zeros(count, dtype=bool)
    for first_char, end_char in spans:
        first = encoding.char_to_token(first_char)
        if first is None:
            break
        last = encoding.char_to_token(end_char - 1)
        mask[first : (last + 1 if last else count)] = True
    return mask


def _labels(ids: np.ndarray, mask: np.ndarray, mask_inputs: bool) -> np.ndarray:
    return np.where(mask, ids, IGNORE_INDEX) if mask_inputs else ids.copy()


def row_tools(row: dict[str, Any], markers: bool, tokenizer: Any = None) -> list[Any] | None:
    """A row's ``tools`` column (TRL's: the JSON schemas of the tools its conversation may call), rendered by
    the chat template into the conversation."""
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise RowError("'tools' is text that is not JSON; give a list of tool schemas") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowError("'tools' must be a list of JSON tool schemas ({type: function, function: {...}})")
    if not markers:
        raise RowError(
            "'tools' needs a chat template that marks assistant turns with {% generation %} (tokenizer.chat_template: "
            "hermes renders tools)"
        )
    if tools and tokenizer is not None:
        try:
            check_tools_rendered(tokenizer, "the row has a 'tools' column")
        except UserError as error:
            raise RowError(str(error)) from None
    return tools


def format_sft_batch(
    rows: list[dict[str, Any]], tokenizer: Any, mask_inputs: bool = True, check_end_of_turn: bool = True
) -> list[dict[str, np.ndarray] | RowError]:
    """Many chat rows at once: a sample (int64 ``input_ids`` and ``labels`` arrays) or the row's error.

    With ``{% generation %}`` markers the rows are rendered, tokenized in one call of the fast tokenizer, and
    labelled by looking up the tokens that hold each span's first and last character (the same tokens and mask as ``apply_chat_template``).
    Other templates go row by row through token-exact prefix rendering."""
    out: list[Any] = [None] * len(rows)
    conversations, where, tools = [], [], []
    markers = has_generation_markers(tokenizer)
    for index, row in enumerate(rows):
        try:
            conversations.append(check_messages(chat_messages(row)))
            tools.append(row_tools(row, markers, tokenizer))
            where.append(index)
        except RowError as exc:
            out[index] = exc
            del conversations[len(tools) :]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if conversations and backend is not None and markers:
        texts, spans = render_with_spans(tokenizer, conversations, tools)
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        pieces = [
            (np.fromiter(e.ids, dtype=np.int64, count=len(e)), _span_mask(e, s))
            for e, s in zip(encodings, spans, strict=True)
        ]
    else:
        pieces = []
        for messages in conversations:
            try:
                ids, mask = assistant_mask(tokenizer, messages)
                pieces.append((np.array(ids, dtype=np.int64), np.array(mask, dtype=bool)))
            except RowError as exc:
                pieces.append(exc)
    for index, messages, piece in zip(where, conversations, pieces, strict=True):
        if isinstance(piece, RowError):
            out[index] = piece
            continue
        ids, mask = piece
        try:
            mask = drop_context_turns(mask, messages)
            if check_end_of_turn:
                check_turn_ends(tokenizer, ids, mask)
            out[index] = {"input_ids": ids, "labels": _labels(ids, mask, mask_inputs)}
        except RowError as exc:
            out[index] = exc
    return out


def format_sft(
    row: dict[str, Any], tokenizer: Any, mask_inputs: bool = True, check_end_of_turn: bool = True
) -> dict[str, list[int]]:
    """One chat row -> ``input_ids`` and ``labels`` lists (see :func:`format_sft_batch`)."""
    result = format_sft_batch([row], tokenizer, mask_inputs, check_end_of_turn)[0]
    if isinstance(result, RowError):
        raise result
    return {key: value.tolist() for key, value in result.items()}


def format_sft_rows(rows: list[dict[str, Any]], tokenizer: Any, config: SFTDataConfig) -> list[Any]:
    """The ``sft`` data factory's batch formatter: :func:`format_sft_batch` with the data config's options."""
    return format_sft_batch(rows, tokenizer, config.mask_inputs, config.check_end_of_turn)
