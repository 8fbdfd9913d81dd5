"""The vocabulary every data stage shares: what a sample is, the ignored label, the row error, checked chat
messages, rendering with the tokenizer's chat template, counting trained tokens, and padding rows into a
batch. Formatters (SFT, DPO, causal), the store, packing, collators and reports all take these from here, so
they count and check the same way."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: the label of a position that is not trained (PyTorch's cross-entropy ``ignore_index``)
IGNORE_INDEX = -100
#: the message roles a conversation may hold
ROLES = ("system", "user", "assistant", "tool")
#: a formatted sample: ``input_ids`` and ``labels`` (and ``position_ids`` once packed), lists or int arrays
Sample = dict[str, Any]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RowError(ValueError):
    """A row that cannot be formatted; the caller adds the file and row number."""


# ------------------------------------------------------------------ trained tokens


def trained_tokens(labels: Any) -> int:
    """Labels that are predicted: every position after the first (of each row, for a 2-D batch) whose label
    is not ignored. Works on lists, numpy arrays and tensors alike."""
    if isinstance(labels, torch.Tensor):
        return int((labels[..., 1:] != IGNORE_INDEX).sum())
    return int(np.count_nonzero(np.asarray(labels)[..., 1:] != IGNORE_INDEX))


def trained_per_sample(labels: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """:func:`trained_tokens` of each of the samples laid one after another in ``labels`` with ``lengths``."""
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int32)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    predicted = (np.asarray(labels) != IGNORE_INDEX).astype(np.int64)
    predicted[starts[lengths > 0]] = 0  # the first position of each sample predicts nothing
    totals = np.concatenate([[0], np.cumsum(predicted)])  # empty samples (a KTO row's absent side) sum to 0
    return (totals[starts + lengths] - totals[starts]).astype(np.int32)


# ------------------------------------------------------------------ documents in a row

#: the batch keys that carry where documents start and end in rows holding several (packed, padding-free):
#: transformers' own names for flash attention (``cu_seq_lens_*`` int32 tensors over the flattened batch,
#: ``max_length_*`` ints), plus ``document_bounds``, the same bounds as an int64 tensor that stays on the host
#: (never moved to the device, so no layer waits on the device to read them)
DOCUMENT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "document_bounds")
#: the model input that marks a sequence-parallel forward (``models.sequence_parallel.slice_rows``): attention
#: runs through Ulysses only when it is given (a generation on the same model, whose rows are whole on every
#: process, runs the plain kernel)
SLICED = "sequence_sliced"
#: batch tensors the loop leaves on the host
HOST_KEYS = frozenset({"document_bounds"})


def target_labels(batch: dict[str, Any]) -> torch.Tensor:
    """The label each position predicts (the next token's label; -100: none): ``shift_labels`` when the batch
    carries them (sequence parallelism slices already-shifted labels), else ``labels`` shifted left."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)


def target_rows(batch: dict[str, Any]) -> torch.Tensor:
    """The flat positions (over ``[rows x tokens]``) that predict a label, found on the host: the tiled loss
    computes only these, and would otherwise read them back from the device."""
    return torch.nonzero(target_labels(batch).reshape(-1) != IGNORE_INDEX).squeeze(1)


def document_bounds(position_ids: torch.Tensor) -> dict[str, Any]:
    """Where each document starts and ends in a batch whose positions restart at 0 for every document (and
    every row), over the rows laid end to end; computed once per micro-batch on the host, handed to every
    attention layer. Also ``num_attention_sq``: the sum of the documents' squared lengths (what causal
    attention costs, for the FLOPs estimate)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).squeeze(1).tolist() if flat.numel() else []
    if starts[:1] != [0]:
        starts = [0, *starts]
    bounds = (*starts, flat.numel())
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    cumulative = torch.tensor(bounds, dtype=torch.int32)
    longest = max(lengths, default=0)
    return {
        "cu_seq_lens_q": cumulative,
        "cu_seq_lens_k": cumulative,
        "max_length_q": longest,
        "max_length_k": longest,
        "document_bounds": torch.tensor(bounds, dtype=torch.int64),
        "num_attention_sq": sum(n * n for n in lengths),
    }


# ------------------------------------------------------------------ batches


def pad_rows(rows: Sequence[tuple[Any, Any]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` rows padded on the right to the longest: ids with ``pad_id``, labels with
    :data:`IGNORE_INDEX`, and the attention mask (1 on real tokens)."""
    longest = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(rows), longest), dtype=torch.long)
    for index, (ids, row_labels) in enumerate(rows):
        input_ids[index, : len(ids)] = torch.as_tensor(ids)
        labels[index, : len(row_labels)] = torch.as_tensor(row_labels)
        attention[index, : len(ids)] = 1
    return input_ids, labels, attention


#: the model inputs of a joined micro-batch (``joined_rows``), under the batch's ``joined`` key
JOINED = "joined"


def joined_rows(input_ids: torch.Tensor, attention: torch.Tensor) -> dict[str, Any]:
    """Right-padded rows joined into one row without their padding, for a forward that attends per document:
    ``input_ids`` and ``position_ids`` (restarting at every row) ``[1, real tokens]``, the documents' bounds,
    and ``index``: where each joined token sits in the rows laid end to end (``[rows x tokens]``, flat)."""
    real = attention.bool()
    index = real.reshape(-1).nonzero().squeeze(1)
    positions = torch.cat([torch.arange(int(n)) for n in real.sum(1)]).unsqueeze(0)
    bounds = document_bounds(positions)
    del bounds["num_attention_sq"]
    return {
        "input_ids": input_ids.reshape(-1)[index].unsqueeze(0),
        "position_ids": positions,
        "index": index,
    } | bounds


# ------------------------------------------------------------------ chat messages and rendering


def check_messages_shape(messages: Any) -> list[dict[str, Any]]:
    """A non-empty list of valid ``{role, content}`` messages (a prompt need not hold an assistant turn)."""
    if not isinstance(messages, list) or not messages:
        raise RowError("'messages' must be a non-empty list of {role, content} objects")
    return [_checked_message(index, message) for index, message in enumerate(messages)]


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A conversation, checked: a non-empty list of ``{role, content}`` messages with a trained assistant
    message. An assistant message may carry ``train: false`` (context only: not trained). Rows of other
    formats are read into messages first (``data.row_formats.chat_messages``)."""
    clean = check_messages_shape(messages)
    if not any(m["role"] == "assistant" for m in clean):
        raise RowError("the conversation has no assistant message, so nothing would be trained")
    if not any(m["role"] == "assistant" and m.get("train", True) for m in clean):
        raise RowError("every assistant message has train: false (label 0), so nothing would be trained")
    return clean


def _checked_message(index: int, message: Any) -> dict[str, Any]:
    if isinstance(message, dict) and message.get("content") is None and message.get("tool_calls"):
        message = {**message, "content": ""}  # TRL's and transformers' tool-call turn: calls, no text
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise RowError(f"messages[{index}] must be an object with 'role' and 'content'")
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise RowError(f"messages[{index}].role {role!r} is not one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise RowError(f"messages[{index}].content must be a string")
    train = message.get("train", True)
    if not isinstance(train, bool) or (role != "assistant" and not train):
        raise RowError(f"messages[{index}].train must be true or false, on an assistant message")
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None:  # an assistant turn calling tools, in transformers' layout
        if role != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls):
            raise RowError(
                f"messages[{index}].tool_calls must be a list of {{type: function, function: {{name, arguments}}}} "
                "on an assistant message"
            )
        out["tool_calls"] = calls
    if role == "tool":
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
    if not train:
        out["train"] = False
    return out


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def keep_prompt_tokens(ids: list[int], limit: int, truncation: str) -> list[int]:
    """At most ``limit`` tokens of a prompt (0: all): its first (``keep_start``) or last (``keep_end``)."""
    if not limit or len(ids) <= limit:
        return ids
    return ids[:limit] if truncation == "keep_start" else ids[len(ids) - limit :]


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the chat template marks assistant turns with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return bool(_GENERATION_TAG.search(template if isinstance(template, str) else str(template)))


def render_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of ``messages`` rendered with the tokenizer's chat template (and the tools' schemas, for
    a template that renders them)."""
    return list(
        tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=True,
            tools=tools or None,  # None, not []: some templates write their tool preamble for an empty list
        )["input_ids"]
    )


def render_with_spans(
    tokenizer: Any, conversations: list[list[dict[str, Any]]], tools: list[Any] | None = None
) -> tuple[list[str], list[Any]]:
    """Render conversations with the tokenizer's template through transformers' own renderer, with the
    character spans of every ``{% generation %}`` block; ``tools``: each conversation's tool schemas (TRL's
    ``tools`` column; None or an empty list: none), rendered by the template."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = tools or [None] * len(conversations)
    texts: list[str] = [""] * len(conversations)
    spans: list[Any] = [None] * len(conversations)
    groups: dict[str, list[int]] = {}
    for index, schemas in enumerate(tools):  # one renderer call per distinct tool list
        groups.setdefault(json.dumps(schemas or None, sort_keys=True), []).append(index)
    for key, members in groups.items():
        rendered, found = render_jinja_template(
            conversations=[conversations[i] for i in members],
            tools=json.loads(key),
            chat_template=tokenizer.get_chat_template(),
            return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        )
        for i, text, span in zip(members, rendered, found, strict=True):
            texts[i], spans[i] = text, span
    return texts, spans
