"""ERNIEKit's row shapes load directly: erniekit SFT rows (src/tgt, per-turn labels), erniekit preference rows
(response/sort) and chatml preference rows give the same samples as posttrain's own rows."""

from __future__ import annotations

import pytest

from posttrain.data.dpo import format_pair
from posttrain.data.samples import RowError
from posttrain.data.sft import format_sft, format_sft_batch
from tests.unit.test_sft_masking import trained_text

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "reverse 12"},
    {"role": "assistant", "content": "21"},
    {"role": "user", "content": "reverse 345"},
    {"role": "assistant", "content": "543"},
]


def test_erniekit_sft_rows_with_per_turn_labels(tiny_tokenizer) -> None:
    ernie = {"system": "be brief", "src": ["reverse 12", "reverse 345"], "tgt": ["21", "543"]}
    assert format_sft(ernie, tiny_tokenizer) == format_sft({"messages": CHAT}, tiny_tokenizer)
    only_last = format_sft({**ernie, "label": [0, 1]}, tiny_tokenizer)
    assert only_last["input_ids"] == format_sft({"messages": CHAT}, tiny_tokenizer)["input_ids"]
    assert trained_text(tiny_tokenizer, only_last) == ["543<|im_end|>"]
    # the batched path (spans through the fast tokenizer) agrees with the row path
    batched = format_sft_batch([{**ernie, "label": [1, 0]}], tiny_tokenizer)[0]
    assert trained_text(tiny_tokenizer, {k: list(v) for k, v in batched.items()}) == ["21<|im_end|>"]


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"src": ["a", "b"], "tgt": ["x"]}, "same, non-zero length"),
        ({"src": ["a"], "tgt": ["x"], "label": [2]}, "0/1"),
        ({"src": ["a"], "tgt": ["x"], "label": [0]}, "nothing would be trained"),
        ({"src": "a", "tgt": [3]}, "list of strings"),
    ],
)
def test_bad_erniekit_rows_say_what_is_wrong(tiny_tokenizer, row: dict, says: str) -> None:
    with pytest.raises(RowError, match=says):
        format_sft(row, tiny_tokenizer)


def test_erniekit_and_chatml_preference_rows(tiny_tokenizer) -> None:
    prompt = CHAT[:4]
    ours = format_pair({"prompt": prompt, "chosen": "543", "rejected": "345"}, tiny_tokenizer)
    ernie = {
        "system": "be brief",
        "src": ["reverse 12", "reverse 345"],
        "tgt": ["21"],
        "response": [["345"], ["543"]],
        "sort": [0, 1],
    }
    assert format_pair(ernie, tiny_tokenizer) == ours
    chatml = {"messages": prompt, "chosen": "543", "rejected": "345"}
    assert format_pair(chatml, tiny_tokenizer) == ours
    with pytest.raises(RowError, match="same 'sort' value"):
        format_pair({**ernie, "sort": [1, 1]}, tiny_tokenizer)
    with pytest.raises(RowError, match="one item fewer"):
        format_pair({**ernie, "tgt": []}, tiny_tokenizer)
