"""Continued pretraining data: raw text -> BOS + tokens + EOS per document -> blocks or packed documents."""

from __future__ import annotations

from typing import Any

import numpy as np

from posttrain.config.data import CausalDataConfig, DataConfig
from posttrain.data.packing import pack_bins
from posttrain.data.samples import RowError, Sample
from posttrain.data.store import SampleStore
from posttrain.data.views import BlockView, PackedView, View


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


def format_documents(
    rows: list[dict[str, Any]], tokenizer: Any, text_column: str, add_bos: bool, add_eos: bool
) -> list[dict[str, np.ndarray] | RowError]:
    """Many documents at once: one call of the tokenizer for the batch; rows without text become errors."""
    out: list[Any] = [None] * len(rows)
    texts, where = [], []
    for index, row in enumerate(rows):
        text = row.get(text_column)
        if isinstance(text, str):
            texts.append(text)
            where.append(index)
        else:
            present = ", ".join(map(str, row)) or "none"
            out[index] = RowError(
                f"needs a string column {text_column!r} (data.text_column); columns present: {present}"
            )
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    head = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    tail = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    for index, ids in zip(where, encoded, strict=True):
        tokens = np.array(head + ids + tail, dtype=np.int64)
        out[index] = {"input_ids": tokens, "labels": tokens.copy()}
    return out


def format_causal_rows(rows: list[dict[str, Any]], tokenizer: Any, config: CausalDataConfig) -> list[Any]:
    """The ``causal`` data factory's batch formatter, with the data config's column and BOS/EOS options."""
    return format_documents(rows, tokenizer, config.text_column, config.add_bos, config.add_eos)


def keep_document(sample: dict[str, Any], max_length: int, config: DataConfig) -> tuple[Any, str, bool]:
    """Documents are kept whole when stored; long ones are cut into blocks or chunks when assembled."""
    return sample, "", False


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
    store: SampleStore, samples: np.ndarray, max_length: int, config: DataConfig, pack: bool
) -> View:
    """Without packing: ``max_length`` blocks of the concatenated documents. With packing: documents cut into
    chunks of at most ``max_length`` tokens (chunks of one token dropped), shuffled with ``data.seed``, and
    packed per ``data.packing`` with per-chunk positions."""
    if not pack:
        return BlockView(store, samples, max_length)
    lengths = store.lengths("input_ids")[samples]
    pieces = -(-lengths // max_length)
    document = np.repeat(samples, pieces)
    first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = (np.arange(len(document)) - first_piece) * max_length
    length = np.minimum(max_length, np.repeat(lengths, pieces) - start)
    keep = length >= 2
    document, start, length = document[keep], start[keep], length[keep]
    order = np.random.default_rng(config.seed).permutation(len(document))
    spans = (document[order], start[order], length[order])
    offsets, members = pack_bins(spans[2], max_length, config.packing)
    return PackedView(store, spans, offsets, members)
