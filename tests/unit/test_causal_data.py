from __future__ import annotations

import pytest

from posttrain.data.causal import concat_blocks, format_document, split_documents
from posttrain.data.samples import RowError


def doc(*ids: int) -> dict[str, list[int]]:
    return {"input_ids": list(ids), "labels": list(ids)}


def test_concat_blocks_cuts_the_stream() -> None:
    blocks = concat_blocks([doc(1, 2, 3), doc(4, 5), doc(6, 7, 8, 9)], max_length=4)
    assert [b["input_ids"] for b in blocks] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # a 1-token tail is dropped
    assert all(b["labels"] == b["input_ids"] for b in blocks)


def test_split_long_documents() -> None:
    chunks = split_documents([doc(1, 2, 3, 4, 5), doc(6, 7)], max_length=2)
    assert [c["input_ids"] for c in chunks] == [[1, 2], [3, 4], [6, 7]]


def test_format_document_adds_bos_eos(tiny_tokenizer) -> None:
    sample = format_document({"text": "hello world"}, tiny_tokenizer, "text", add_bos=True, add_eos=True)
    assert sample["input_ids"][0] == tiny_tokenizer.bos_token_id
    assert sample["input_ids"][-1] == tiny_tokenizer.eos_token_id
    assert sample["labels"] == sample["input_ids"]
    bare = format_document({"body": "hello world"}, tiny_tokenizer, "body", add_bos=False, add_eos=False)
    assert bare["input_ids"] == sample["input_ids"][1:-1]
    with pytest.raises(RowError, match=r"needs a string column .text.*columns present: body"):
        format_document({"body": "x"}, tiny_tokenizer, "text", True, True)
