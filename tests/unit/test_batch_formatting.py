"""The batched SFT formatter gives the same tokens and assistant mask as ``apply_chat_template`` row by row."""

from __future__ import annotations

import random
from copy import deepcopy

import numpy as np
import pytest

from posttrain.data.samples import IGNORE_INDEX, RowError
from posttrain.data.sft import format_sft_batch
from posttrain.tokenizers.chat_templates import apply_chat_template

WORDS = "the answer is 42 , ok ! ünïcødé 日本語 tab\there  two  spaces\nnew line <|im_end|> [INST]".split(" ")


def conversations(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))})
        for _ in range(rng.randint(1, 3)):
            for role in ("user", "assistant"):
                text = " ".join(rng.choices(WORDS, k=rng.randint(1, 60)))
                messages.append({"role": role, "content": text if rng.random() < 0.9 else f" {text} "})
        rows.append({"messages": messages})
    return rows


@pytest.mark.parametrize("preset", ["keep-original", "chatml", "llama3", "mistral-with-system"])
def test_batch_equals_row_by_row_apply_chat_template(tiny_tokenizer, preset: str) -> None:
    tokenizer = deepcopy(tiny_tokenizer)
    apply_chat_template(tokenizer, preset)
    rows = conversations(60, seed=len(preset))
    batch = format_sft_batch(rows, tokenizer, check_end_of_turn=False)
    for row, sample in zip(rows, batch, strict=True):
        reference = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert sample["input_ids"].tolist() == list(reference["input_ids"])
        expected = [
            t if m else IGNORE_INDEX
            for t, m in zip(reference["input_ids"], reference["assistant_masks"], strict=True)
        ]
        assert sample["labels"].tolist() == expected


def test_bad_rows_come_back_as_errors_in_place(tiny_tokenizer) -> None:
    rows = [*conversations(2), {"messages": []}, *conversations(1, seed=5)]
    out = format_sft_batch(rows, tiny_tokenizer)
    assert isinstance(out[2], RowError) and "non-empty list" in str(out[2])
    assert all(isinstance(s["input_ids"], np.ndarray) for i, s in enumerate(out) if i != 2)
