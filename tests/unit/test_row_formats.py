"""Chat rows as people keep them on disk: Alpaca, ShareGPT (with a source's column and role maps), TRL's
prompt-completion, Megatron-Bridge's input/output; a row never half-read; plain text sent to ``causal``."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.data.row_formats import chat_messages
from posttrain.data.samples import IGNORE_INDEX, RowError
from posttrain.data.sft import format_sft
from posttrain.data.sources import ListReader, MappedReader, Row


def trained_text(tokenizer, sample: dict) -> str:
    ids, labels = np.array(sample["input_ids"]), np.array(sample["labels"])
    return tokenizer.decode(ids[labels != IGNORE_INDEX])


def test_alpaca_rows_keep_the_instruction(tiny_tokenizer) -> None:
    row = {"instruction": "reverse 123", "input": "", "output": "321"}
    assert chat_messages(row) == [
        {"role": "user", "content": "reverse 123"},
        {"role": "assistant", "content": "321"},
    ]
    with_input = chat_messages(
        {"instruction": "reverse", "input": "123", "output": "321", "system": "be brief"}
    )
    assert with_input[0] == {"role": "system", "content": "be brief"}
    assert with_input[1] == {"role": "user", "content": "reverse\n\n123"}
    sample = format_sft(row, tiny_tokenizer)
    assert trained_text(tiny_tokenizer, sample) == "321<|im_end|>"
    assert "reverse 123" in tiny_tokenizer.decode(sample["input_ids"])
    with pytest.raises(RowError, match="both empty"):
        chat_messages({"instruction": " ", "input": "", "output": "x"})


def test_sharegpt_rows_and_their_roles(tiny_tokenizer) -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "yo"},
        ]
    }
    assert [m["role"] for m in chat_messages(row)] == ["system", "user", "assistant"]
    assert trained_text(tiny_tokenizer, format_sft(row, tiny_tokenizer)) == "yo<|im_end|>"
    with pytest.raises(RowError, match=r"'bot' is not one of .*roles: \{bot: assistant\}"):
        chat_messages({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]})


def test_prompt_completion_rows(tiny_tokenizer) -> None:
    plain = {"prompt": "reverse 12", "completion": "21"}
    assert chat_messages(plain)[1] == {"role": "assistant", "content": "21"}
    listed = {
        "prompt": [{"role": "user", "content": "reverse 12"}],
        "completion": [{"role": "assistant", "content": "21"}],
    }
    assert format_sft(plain, tiny_tokenizer) == format_sft(listed, tiny_tokenizer)
    megatron = {"input": "reverse 12", "output": "21"}
    assert format_sft(megatron, tiny_tokenizer) == format_sft(plain, tiny_tokenizer)


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "a", "completion": "b", "text": "c"}, "prompt-completion row that also holds 'text'"),
        (
            {"messages": [{"role": "user", "content": "a"}], "output": "b"},
            "messages row that also holds 'output'",
        ),
        ({"text": "hi"}, "plain-text row .keys: text. has no conversation: train text with type: causal"),
        (
            {"question": "a", "answer": "b"},
            r"no conversation in this row \(keys: question, answer\); posttrain reads",
        ),
    ],
)
def test_rows_are_never_half_read(row: dict, says: str) -> None:
    with pytest.raises(RowError, match=says):
        chat_messages(row)


def test_a_sources_column_and_role_maps() -> None:
    rows = [
        Row(
            {"id": 7, "dialog": [{"speaker": "customer", "text": "hi"}, {"speaker": "bot", "text": "yo"}]},
            "f row 1",
        )
    ]
    reader = MappedReader(
        ListReader(rows),
        {"conversations": "dialog", "from": "speaker", "value": "text"},
        {"customer": "human", "bot": "gpt"},
    )
    (mapped,) = list(reader.rows())
    assert chat_messages(mapped.data) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    assert mapped.origin == "f row 1" and mapped.data["id"] == 7
    alpaca = MappedReader(
        ListReader([Row({"question": "q", "answer": "a"}, "g row 1")]),
        {"instruction": "question", "output": "answer"},
        {},
    )
    assert chat_messages(next(iter(alpaca.rows())).data)[0]["content"] == "q"


def test_grpo_prompt_rows_as_trl_keeps_them() -> None:
    from posttrain.data.prompts import prompt_of, reward_columns
    from posttrain.data.samples import RowError

    chat = [{"role": "user", "content": "reverse 12"}]
    assert prompt_of({"prompt": chat, "answer": "21"}) == chat and prompt_of({"prompt": "2+2="}) == "2+2="
    assert prompt_of({"messages": chat}) == chat
    assert reward_columns({"prompt": chat, "answer": "21", "__origin__": "f row 1"}) == {"answer": "21"}
    with pytest.raises(RowError, match="no prompt"):
        prompt_of({"question": "x"})
    with pytest.raises(RowError, match="ends with an assistant turn"):
        prompt_of({"messages": [*chat, {"role": "assistant", "content": "21"}]})
