from __future__ import annotations

import pytest

from posttrain.data.samples import IGNORE_INDEX, RowError
from posttrain.data.sft import format_sft


def trained_text(tokenizer, sample: dict) -> list[str]:
    """Decode each maximal run of trained tokens separately."""
    runs, current = [], []
    for token, label in zip(sample["input_ids"], sample["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_single_turn_trains_answer_and_eos(tiny_tokenizer) -> None:
    row = {"messages": [{"role": "user", "content": "reverse 123"}, {"role": "assistant", "content": "321"}]}
    sample = format_sft(row, tiny_tokenizer)
    assert trained_text(tiny_tokenizer, sample) == ["321<|im_end|>"]
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # the EOS that closes the assistant turn is trained; the one closing the user turn is not
    positions = [i for i, t in enumerate(sample["input_ids"]) if t == eos]
    assert [sample["labels"][i] for i in positions] == [IGNORE_INDEX, eos]


def test_multi_turn_with_system_and_repeated_content(tiny_tokenizer) -> None:
    row = {
        "messages": [
            {"role": "system", "content": "echo"},
            {"role": "user", "content": "echo"},
            {"role": "assistant", "content": "echo"},
            {"role": "user", "content": "echo"},
            {"role": "assistant", "content": "echo"},
        ]
    }
    sample = format_sft(row, tiny_tokenizer)
    # same text in every role, yet only the two assistant turns are trained (no text search)
    assert trained_text(tiny_tokenizer, sample) == ["echo<|im_end|>", "echo<|im_end|>"]


def test_mask_inputs_false_trains_everything(tiny_tokenizer) -> None:
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    sample = format_sft(row, tiny_tokenizer, mask_inputs=False)
    assert sample["labels"] == sample["input_ids"]


def test_template_without_markers_uses_token_prefixes(tiny_tokenizer) -> None:
    from copy import deepcopy

    plain = deepcopy(tiny_tokenizer)
    plain.chat_template = plain.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    rows = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                      {"role": "assistant", "content": "x"}, {"role": "user", "content": "x"},
                      {"role": "assistant", "content": "y"}]},
    ]  # fmt: skip
    for row in rows:
        marked, unmarked = format_sft(row, tiny_tokenizer), format_sft(row, plain)
        assert marked["input_ids"] == unmarked["input_ids"]
        # the prefix method also trains the newline after the end-of-turn token; everything else is equal
        assert [r.rstrip("\n") for r in trained_text(plain, unmarked)] == trained_text(tiny_tokenizer, marked)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "hi"}, "train text with type: causal"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "'robot' is not one of"),
        ({"messages": [{"role": "user"}]}, "'role' and 'content'"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant message"),
    ],
)
def test_bad_rows(tiny_tokenizer, row: dict, message: str) -> None:
    with pytest.raises(RowError, match=message):
        format_sft(row, tiny_tokenizer)
