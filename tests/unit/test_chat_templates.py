"""Chat-template presets, .jinja files, the end-of-turn check, and missing-pad-token strategies."""

from __future__ import annotations

import logging
from copy import deepcopy

import pytest
import torch

from posttrain.data.collate import Collator
from posttrain.data.samples import IGNORE_INDEX, RowError
from posttrain.data.sft import format_sft
from posttrain.errors import UserError
from posttrain.tokenizers.chat_templates import apply_chat_template, check_choice
from posttrain.tokenizers.padding import ensure_pad_token, input_pad_id

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse 123"},
        {"role": "assistant", "content": "321"},
        {"role": "user", "content": "reverse 45"},
        {"role": "assistant", "content": "54"},
    ]
}


def trained(tokenizer, sample) -> str:
    return tokenizer.decode(
        [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != IGNORE_INDEX]
    )


@pytest.mark.parametrize(
    ("preset", "expected", "added"),
    [
        ("chatml", "321<|im_end|>54<|im_end|>", 0),
        ("chat-ml", "321<|im_end|>54<|im_end|>", 0),
        ("llama3", "321<|eot_id|>54<|eot_id|>", 3),
        ("simplified-llama31", "321<|eot_id|>54<|eot_id|>", 3),
        ("mistral-with-system", " 321<|im_end|> 54<|im_end|>", 0),  # EOS of the tiny tokenizer
        ("poro", "321<|im_end|>54<|im_end|>", 2),
    ],
)
def test_presets_label_exactly_the_answers_and_their_end_of_turn(
    tiny_tokenizer, preset, expected, added
) -> None:
    tokenizer = deepcopy(tiny_tokenizer)
    size = len(tokenizer)
    assert len(apply_chat_template(tokenizer, preset)) == added
    assert len(tokenizer) == size + added  # missing special tokens become single tokens
    sample = format_sft(CONVERSATION, tokenizer)
    assert trained(tokenizer, sample) == expected
    if preset == "mistral-with-system":
        assert tokenizer.decode(sample["input_ids"]).startswith(
            "<|begin_of_text|>[INST] be brief\n\nreverse 123 [/INST]"
        )


def test_poro_renders_silogen_turns(tiny_tokenizer) -> None:
    # SiloGen's poro: role tag, newline, content, EOS for every turn; <|user|> and <|assistant|> are added
    tokenizer = deepcopy(tiny_tokenizer)
    assert apply_chat_template(tokenizer, "poro") == ["<|user|>", "<|assistant|>"]
    eos = tokenizer.eos_token
    text = tokenizer.apply_chat_template(CONVERSATION["messages"][:3], tokenize=False)
    assert text == f"<|system|>\nbe brief{eos}<|user|>\nreverse 123{eos}<|assistant|>\n321{eos}"
    prompt = tokenizer.apply_chat_template(
        CONVERSATION["messages"][:2], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith(f"<|user|>\nreverse 123{eos}<|assistant|>\n")
    ids = tokenizer.encode("<|user|><|assistant|>", add_special_tokens=False)
    assert ids == tokenizer.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])  # one token each
    # assistant-only labels and the end-of-turn check (format_sft runs it) hold
    sample = format_sft(CONVERSATION, tokenizer)
    assert trained(tokenizer, sample) == f"321{eos}54{eos}"


def test_jinja_file_and_keep_original(tiny_tokenizer, tmp_path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tokenizer = deepcopy(tiny_tokenizer)
    apply_chat_template(tokenizer, str(path))
    sample = format_sft(CONVERSATION, tokenizer)  # no markers: token-exact prefix rendering
    assert trained(tokenizer, sample) == "321<|im_end|>\n54<|im_end|>\n"
    with pytest.raises(UserError, match="no such file"):
        apply_chat_template(tokenizer, str(tmp_path / "missing.jinja"))
    bare = deepcopy(tiny_tokenizer)
    bare.chat_template = None
    with pytest.raises(UserError, match="has no chat template"):
        apply_chat_template(bare, "keep-original")
    with pytest.raises(ValueError, match="allowed: keep-original, chatml"):
        check_choice("vicuna")


def test_end_of_turn_outside_the_generation_block_is_refused(tiny_tokenizer) -> None:
    tokenizer = deepcopy(tiny_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
    )
    with pytest.raises(RowError, match=r"assistant turn 1 ends with .* never learn to stop"):
        format_sft(CONVERSATION, tokenizer)
    assert trained(tokenizer, format_sft(CONVERSATION, tokenizer, check_end_of_turn=False)) == "32154"


def _without_pad(tokenizer):
    tokenizer = deepcopy(tokenizer)
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    return tokenizer


def test_pad_strategies(tiny_tokenizer, caplog) -> None:
    bos = _without_pad(tiny_tokenizer)
    assert "BOS" in ensure_pad_token(bos, "bos-repurpose") and bos.pad_token_id == bos.bos_token_id
    eos = _without_pad(tiny_tokenizer)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        ensure_pad_token(eos, "eos-repurpose")
    assert eos.pad_token_id == eos.eos_token_id and "never learns to stop" in caplog.text
    assert ensure_pad_token(eos, "bos-repurpose") is None  # a tokenizer with a pad token is left alone
    with pytest.raises(UserError, match="no UNK token"):
        ensure_pad_token(_without_pad(tiny_tokenizer), "unk-repurpose")


def test_unk_convert_to_eos_pads_inputs_with_eos_and_never_trains_padding(tiny_tokenizer) -> None:
    tokenizer = _without_pad(tiny_tokenizer)
    tokenizer.unk_token = "<|end_of_text|>"
    ensure_pad_token(tokenizer, "unk-convert-to-eos")
    assert tokenizer.pad_token_id == tokenizer.unk_token_id
    pad = input_pad_id(tokenizer, "unk-convert-to-eos")
    assert pad == tokenizer.eos_token_id
    batch = Collator(pad)([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"][1].tolist() == [8, pad, pad]
    assert batch["labels"][1].tolist() == [8, IGNORE_INDEX, IGNORE_INDEX]
    assert torch.equal(batch["attention_mask"][1], torch.tensor([1, 0, 0]))
    assert input_pad_id(tokenizer, "unk-repurpose") == tokenizer.unk_token_id


MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def test_trls_tool_call_rows_train_and_a_template_that_drops_tools_is_refused(tiny_tokenizer) -> None:
    """TRL's and transformers' layout: an assistant turn with ``tool_calls`` and no ``content``, then a
    ``tool`` message; with a template that renders tools it trains the calls and the answer, with one that
    drops them the row says which presets render them."""
    import copy

    from posttrain.data.samples import RowError
    from posttrain.data.sft import format_sft_batch
    from posttrain.tokenizers.chat_templates import apply_chat_template, tool_presets

    row = {
        "messages": [
            {"role": "user", "content": "What is 6 times 7?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
                ],
            },
            {"role": "tool", "name": "multiply", "content": "42"},
            {"role": "assistant", "content": "42"},
        ],
        "tools": [MULTIPLY],
    }
    hermes = copy.deepcopy(tiny_tokenizer)
    apply_chat_template(hermes, "hermes")
    [sample] = format_sft_batch([row], hermes)
    assert not isinstance(sample, RowError), sample
    trained = hermes.decode([t for t in sample["labels"].tolist() if t >= 0])
    assert '"name": "multiply"' in trained and "42" in trained  # the call and the answer, both trained
    prompt = hermes.decode(sample["input_ids"].tolist())
    assert "Multiply two integers." in prompt  # the tool's schema, rendered
    chatml = copy.deepcopy(tiny_tokenizer)
    apply_chat_template(chatml, "chatml")
    [refused] = format_sft_batch([row], chatml)
    assert isinstance(refused, RowError)
    assert "does not render tools" in str(refused) and "tokenizer.chat_template: hermes" in str(refused)
    assert tool_presets() == ["hermes"]
