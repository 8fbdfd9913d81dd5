from __future__ import annotations

import pytest

from posttrain.data.dpo import format_pair
from posttrain.data.samples import IGNORE_INDEX, RowError


def trained(tokenizer, ids: list[int], labels: list[int]) -> str:
    return tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


def test_strings_messages_and_silogen_keys_agree(tiny_tokenizer) -> None:
    as_strings = {"prompt": "reverse 12", "chosen": "21", "rejected": "12"}
    as_messages = {
        "prompt": [{"role": "user", "content": "reverse 12"}],
        "chosen": [{"role": "assistant", "content": "21"}],
        "rejected": [{"role": "assistant", "content": "12"}],
    }
    silogen = {f"{k}_messages": v for k, v in as_messages.items()}
    a, b, c = (format_pair(row, tiny_tokenizer) for row in (as_strings, as_messages, silogen))
    assert a == b == c
    assert trained(tiny_tokenizer, a["chosen_input_ids"], a["chosen_labels"]) == "21<|im_end|>"
    assert trained(tiny_tokenizer, a["rejected_input_ids"], a["rejected_labels"]) == "12<|im_end|>"


def test_assistant_turns_inside_the_prompt_are_not_trained(tiny_tokenizer) -> None:
    row = {
        "prompt": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "reverse 12"},
        ],
        "chosen": "21",
        "rejected": "12",
    }
    pair = format_pair(row, tiny_tokenizer)
    assert trained(tiny_tokenizer, pair["chosen_input_ids"], pair["chosen_labels"]) == "21<|im_end|>"


@pytest.mark.parametrize("side", ["keep_start", "keep_end"])
def test_prompt_truncation(tiny_tokenizer, side: str) -> None:
    prompt = "reverse " + "1" * 30
    row = {"prompt": prompt, "chosen": "answer", "rejected": "other"}
    full = format_pair(row, tiny_tokenizer)["chosen_input_ids"]
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=True, return_dict=True
    )
    p = len(rendered["input_ids"])
    assert p > 8
    cut = format_pair(row, tiny_tokenizer, max_prompt_length=8, truncation=side)
    kept = full[:8] if side == "keep_start" else full[p - 8 : p]
    assert cut["chosen_input_ids"] == kept + full[p:]  # the answer part is untouched
    assert trained(tiny_tokenizer, cut["chosen_input_ids"], cut["chosen_labels"]) == "answer<|im_end|>"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "p", "chosen": "c"}, "missing 'rejected'"),
        ({"prompt": "p", "chosen": [], "rejected": "r"}, "'chosen' must be a string or a non-empty list"),
        (
            {"prompt": "p", "chosen": [{"role": "user", "content": "x"}], "rejected": "r"},
            "prompt \\+ chosen: the conversation has no assistant message",
        ),
    ],
)
def test_bad_pairs(tiny_tokenizer, row: dict, message: str) -> None:
    with pytest.raises(RowError, match=message):
        format_pair(row, tiny_tokenizer)


def test_scores_from_trl_columns_and_erniekit_sort(tiny_tokenizer) -> None:
    from posttrain.data.dpo import SCORES

    trl = {"prompt": "reverse 12", "chosen": "21", "rejected": "12", "score_chosen": 8.5, "score_rejected": 2}
    assert format_pair(trl, tiny_tokenizer, require_scores=True)[SCORES] == [8.5, 2.0]
    ernie = {"src": ["reverse 12"], "tgt": [], "response": [["12"], ["21"], ["1 2"]], "sort": [3, 9, 1]}
    pair = format_pair(ernie, tiny_tokenizer, require_scores=True)
    assert pair[SCORES] == [9.0, 1.0]  # the highest and lowest sorted responses and their scores
    assert trained(tiny_tokenizer, pair["chosen_input_ids"], pair["chosen_labels"]) == "21<|im_end|>"
    plain = {"prompt": "reverse 12", "chosen": "21", "rejected": "12"}
    assert format_pair(plain, tiny_tokenizer)[SCORES] == []
    with pytest.raises(RowError, match="no scores"):
        format_pair(plain, tiny_tokenizer, require_scores=True)
    with pytest.raises(RowError, match="'score_chosen' without 'score_rejected'"):
        format_pair({**plain, "score_chosen": 1.0}, tiny_tokenizer)
    with pytest.raises(RowError, match="below score_rejected"):
        format_pair(
            {**plain, "score_chosen": 1.0, "score_rejected": 2.0}, tiny_tokenizer, require_scores=True
        )
