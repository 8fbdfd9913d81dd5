"""Chat rows with images -> the tokens the processor makes of them, labelled on what the assistant says.

Each row is rendered once with the chat template (the processor's), which writes one image token per image
part. The labels come from that rendering as they do for text (the template's ``{% generation %}`` marks, or
token-exact prefix rendering); the processor then expands every image token into the image's tokens, and
those ids are the sample's: each image is expanded once, by the processor, and what the trainer sees is what
the processor made. The expanded tokens of an image never carry a label. The row's expansion is checked
against the processor's own call on the whole rendered row, whose ids are the sample's: where the two differ
only by tokens joined across an image's edge (Gemma 3 writes "\n\n" around each image, and its vocabulary
joins them with a "\n" beside them into one token), each differing stretch must spell the same text and carry
no label; a processor whose expansion changes the text around an image otherwise is refused rather than
mislabelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain.config.data import DataConfig
from posttrain.data.row_formats import chat_messages
from posttrain.data.samples import IGNORE_INDEX, RowError, check_messages
from posttrain.data.sft import assistant_mask, check_turn_ends, drop_context_turns
from posttrain.data.store import loop_format
from posttrain.vision import images
from posttrain.vision.processor import image_token, processor_of

#: the row key under which each row reaches the formatter with its place (``file row N``)
ORIGIN = "__origin__"


def text_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their text alone, for the checks every chat row gets (roles, a trained turn)."""
    return [
        {
            **m,
            "content": "".join(p.get("text", "") for p in m["content"] if p["type"] == "text"),
        }
        for m in messages
    ]


def expand(processor: Any, ids: np.ndarray, opened: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The processor's expansion of every image token in ``ids`` (one per image, in order): the expanded ids
    and, per expanded position, the position of ``ids`` it comes from (-1: an image's own tokens)."""
    token, token_id = image_token(processor)
    where = np.flatnonzero(ids == token_id)
    if len(where) != len(opened):
        raise RowError(
            f"the chat template wrote {len(where)} image tokens for the row's {len(opened)} images; the "
            "processor's template must write one per image part"
        )
    pieces, origins, start = [], [], 0
    for position, image in zip(where.tolist(), opened, strict=True):
        pieces.append(ids[start:position])
        origins.append(np.arange(start, position))
        expanded = processor(text=[token], images=[image], add_special_tokens=False)["input_ids"][0]
        pieces.append(np.asarray(expanded, dtype=np.int64))
        origins.append(np.full(len(expanded), -1))
        start = position + 1
    pieces.append(ids[start:])
    origins.append(np.arange(start, len(ids)))
    return np.concatenate(pieces).astype(np.int64), np.concatenate(origins).astype(np.int64)


def reconcile(tokenizer: Any, expanded: np.ndarray, own: np.ndarray, labels: np.ndarray) -> np.ndarray | None:
    """The labels of the processor's own ids ``own`` for the in-place expansion ``expanded`` labelled
    ``labels``, where the two differ only by tokens joined across an image's edge: each differing stretch
    spells the same text in both and carries no label (it lies in the prompt, beside an image). None when they
    differ otherwise."""
    from difflib import SequenceMatcher

    out = np.full(len(own), IGNORE_INDEX, dtype=np.int64)
    matcher = SequenceMatcher(None, expanded.tolist(), own.tolist(), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out[j1:j2] = labels[i1:i2]
        elif (labels[i1:i2] != IGNORE_INDEX).any() or _spelled(tokenizer, expanded[i1:i2]) != _spelled(
            tokenizer, own[j1:j2]
        ):
            return None
    return out


def _spelled(tokenizer: Any, ids: Sequence[int] | np.ndarray) -> str:
    """The text ``ids`` spell, special tokens included, nothing cleaned up."""
    ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def collapse(processor: Any, ids: Sequence[int], opened: list[Any]) -> list[int]:
    """``expand`` undone: each image's expansion in ``ids`` (in order) back to the one image token the chat
    template wrote, for an engine that expands the images itself (vLLM), whose expansion is then checked
    against ``ids``. Each expansion is found by its span of special tokens; plain-text edges of it that the
    tokenizer joined with the text beside them (Gemma 3's "\n\n") are split off again. A block that is not
    there is a ``ValueError``."""
    token, token_id = image_token(processor)
    tokenizer = processor.tokenizer
    special = set(tokenizer.all_special_ids)
    out: list[int] = []
    start = 0
    ids = list(ids)
    for image in opened:
        block = list(processor(text=[token], images=[image], add_special_tokens=False)["input_ids"][0])
        marked = [i for i, t in enumerate(block) if t in special] or [0, len(block) - 1]
        lead, core, trail = block[: marked[0]], block[marked[0] : marked[-1] + 1], block[marked[-1] + 1 :]
        found = _find(ids, core, start)
        if found is None:
            raise ValueError("a prompt's ids do not hold its image's expansion where the processor puts it")
        if found - len(lead) >= start and ids[found - len(lead) : found] == lead:
            out += [*ids[start : found - len(lead)], token_id]
        else:
            out += [*_unjoin(tokenizer, ids[start:found], lead, at_end=True), token_id]
        start = found + len(core)
        if ids[start : start + len(trail)] == trail:
            start += len(trail)
        else:
            stop = _next_image_start(ids, start, special, len(ids))
            ids = [*ids[:start], *_unjoin(tokenizer, ids[start:stop], trail, at_end=False), *ids[stop:]]
    return out + ids[start:]


def _find(ids: list[int], block: list[int], start: int) -> int | None:
    return next(
        (i for i in range(start, len(ids) - len(block) + 1) if ids[i : i + len(block)] == block), None
    )


def _next_image_start(ids: list[int], start: int, special: set[int], default: int) -> int:
    """Where the next special token after ``start`` is (the next image's expansion), or ``default``."""
    return next((i for i in range(start, len(ids)) if ids[i] in special), default)


def _unjoin(tokenizer: Any, ids: list[int], edge: list[int], at_end: bool) -> list[int]:
    """``ids`` without the text of ``edge`` (an expansion's plain-text edge, which the processor's tokenizer
    joined with them): the fewest tokens at that end that hold the edge's text are tokenized again without it."""
    if not edge:
        return ids
    edge_text = _spelled(tokenizer, edge)
    for n in range(1, len(ids) + 1):
        spelled = _spelled(tokenizer, ids[-n:] if at_end else ids[:n])
        if at_end and spelled.endswith(edge_text):
            rest = tokenizer.encode(spelled[: len(spelled) - len(edge_text)], add_special_tokens=False)
            return [*ids[:-n], *rest]
        if not at_end and spelled.startswith(edge_text):
            rest = tokenizer.encode(spelled[len(edge_text) :], add_special_tokens=False)
            return [*rest, *ids[n:]]
    raise ValueError("a prompt's ids do not hold its image's expansion where the processor puts it")


def format_image_row(row: dict[str, Any], tokenizer: Any, config: DataConfig) -> dict[str, np.ndarray]:
    """One chat row (with or without images) of a vision-language run -> ``input_ids``, ``labels`` and the
    image references (``images_json``). ``config``: ``mask_inputs`` and ``check_end_of_turn`` as for text."""
    processor = processor_of(tokenizer)
    if row.get("tools"):
        raise RowError("a 'tools' column in a vision-language run: tools with images are not supported yet")
    text_row = {k: v for k, v in row.items() if k != ORIGIN and k not in images.IMAGE_KEYS}
    messages, refs, opened = images_of(row, chat_messages(text_row))
    checked_parts(messages)
    ids, mask = assistant_mask(tokenizer, messages)
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
    mask = drop_context_turns(mask, messages)
    if getattr(config, "check_end_of_turn", True):
        check_turn_ends(tokenizer, ids, mask)
    trained = mask if getattr(config, "mask_inputs", True) else np.ones_like(mask)
    expanded, labels = expand_labelled(
        processor, tokenizer, messages, opened, ids, np.where(trained, ids, IGNORE_INDEX)
    )
    return {"input_ids": expanded, "labels": labels, images.IMAGES_COLUMN: images.encode(refs)}


def images_of(
    row: dict[str, Any], messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[Any]]:
    """``messages`` (the row's, or a part of them) with image parts, the reference of each image (paths taken
    from the row's data file) and each image opened: a missing or unreadable one is the row's error."""
    messages, found = images.parts_of(messages, images.column_images(row))
    directory = images.data_directory(str(row.get(ORIGIN, "")))
    refs = [images.reference(image, directory) for image in found]
    return messages, refs, [images.open_image(ref) for ref in refs]


def expand_labelled(
    processor: Any,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    opened: list[Any],
    ids: Any,
    labels: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """The rendered ``messages``' ids (``ids``, one image token per image) and their ``labels`` with each image
    expanded by the processor, checked against the processor's own call on the whole row. An image's own
    tokens never carry a label."""
    fitted = processor_labelled(processor, tokenizer, messages, opened, ids, labels)
    if fitted is None:
        raise RowError(
            "the processor's tokens for this row differ from its expansion of each image in place (its image "
            "tokens change the text around them), so the labels cannot be placed exactly"
        )
    return fitted


def processor_labelled(
    processor: Any,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    opened: list[Any],
    ids: Any,
    labels: Any,
    add_generation_prompt: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The processor's own ids for the rendered ``messages`` (``ids``: one image token per image, labelled
    ``labels``) and the labels placed on them: each image expanded in place, then reconciled
    (:func:`reconcile`) with the processor's call on the whole conversation. None when they differ otherwise."""
    ids, labels = np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    expanded, origins = expand(processor, ids, opened)
    placed = np.where(origins >= 0, labels[np.maximum(origins, 0)], IGNORE_INDEX)
    own = processor_ids(processor, tokenizer, messages, opened, add_generation_prompt)
    if np.array_equal(own, expanded):
        return expanded, placed
    fitted = reconcile(tokenizer, expanded, own, placed)
    return None if fitted is None else (own, fitted)


def checked_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with image parts, checked on their text (roles, a trained assistant turn) and kept as they
    are for rendering (``data.dpo.Check``)."""
    check_messages(text_view(messages))
    return messages


def processor_ids(
    processor: Any,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    opened: list[Any],
    add_generation_prompt: bool = False,
) -> np.ndarray:
    """The processor's own ids for the rendered conversation and its images (one call, as TRL makes it)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    out = processor(text=[text], images=[opened] if opened else None, add_special_tokens=False)
    return np.asarray(out["input_ids"][0], dtype=np.int64)


#: SFT's batch formatter in a vision-language run: each row's sample or its error
format_image_rows = loop_format(format_image_row)
