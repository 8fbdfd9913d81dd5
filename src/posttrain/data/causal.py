"""Continued pretraining data: raw text -> BOS + tokens + EOS per document -> blocks or packed documents."""

from __future__ import annotations

import random
from typing import Any

from posttrain.data.packing import pack as pack_samples
from posttrain.data.sft import RowError

Sample = dict[str, list[int]]


def format_document(
    row: dict[str, Any], tokenizer: Any, text_column: str, add_bos: bool, add_eos: bool
) -> Sample:
    text = row.get(text_column)
    if not isinstance(text, str):
        present = ", ".join(map(str, row)) or "none"
        raise RowError(
            f"needs a string column {text_column!r} (data.text_column); columns present: {present}"
        )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if add_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    if add_eos and tokenizer.eos_token_id is not None:
        ids = [*ids, tokenizer.eos_token_id]
    return {"input_ids": ids, "labels": list(ids)}


def concat_blocks(documents: list[Sample], max_length: int) -> list[Sample]:
    """Concatenate every document and cut the stream into ``max_length`` blocks (the last, shorter block is
    kept when it has at least two tokens). Tokens attend across document boundaries inside a block, as in
    classic pretraining; use packing to keep documents apart."""
    stream = [token for document in documents for token in document["input_ids"]]
    blocks = [stream[i : i + max_length] for i in range(0, len(stream), max_length)]
    return [{"input_ids": block, "labels": list(block)} for block in blocks if len(block) >= 2]


def split_documents(documents: list[Sample], max_length: int) -> list[Sample]:
    """Documents longer than ``max_length`` become several chunks (each trained as its own sequence)."""
    chunks = []
    for document in documents:
        ids = document["input_ids"]
        for start in range(0, len(ids), max_length):
            piece = ids[start : start + max_length]
            if len(piece) >= 2:
                chunks.append({"input_ids": piece, "labels": list(piece)})
    return chunks


def assemble_documents(
    documents: list[Sample], max_length: int, seed: int, pack: bool, method: str = "best-fit"
) -> list[Sample]:
    if not pack:
        return concat_blocks(documents, max_length)
    chunks = split_documents(documents, max_length)
    random.Random(seed).shuffle(chunks)
    return pack_samples(chunks, max_length, method)
