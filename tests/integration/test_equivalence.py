"""Packing and gradient accumulation change how tokens are batched, never what is learned."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.data.collate import Collator
from posttrain.data.packing import pack_sequential
from posttrain.data.sft import format_sft
from posttrain.methods.sft import sft_loss
from posttrain.testing.data import chat_rows
from tests.integration.helpers import max_diff, merge, train, weights

pytestmark = pytest.mark.integration


def test_packed_loss_equals_token_weighted_unpacked_loss(tiny_model_dir, tiny_tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    samples = [format_sft(row, tiny_tokenizer) for row in chat_rows(6, seed=3)]
    collate = Collator(tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        single = [sft_loss(model, collate([sample]))[0] for sample in samples]
        tokens = [collate([sample])["num_target_tokens"] for sample in samples]
        (packed,) = pack_sequential(samples, max_length=10_000)
        packed_batch = collate([packed])
        packed_sum = sft_loss(model, packed_batch)[0]
    assert packed_batch["num_target_tokens"] == sum(tokens)
    expected = float(sum(single)) / sum(tokens)
    got = float(packed_sum) / packed_batch["num_target_tokens"]
    assert abs(got - expected) < 1e-5, (got, expected)
    # without the restarting position ids, tokens would attend across samples and the loss would differ
    leaky = {k: v for k, v in packed_batch.items() if k != "position_ids"}
    with torch.no_grad():
        leaky_loss = float(sft_loss(model, leaky)[0]) / packed_batch["num_target_tokens"]
    assert abs(leaky_loss - expected) > 1e-3


def test_gradient_accumulation_matches_one_large_batch(base_config) -> None:
    # eps=1 makes Adam's first step ~ lr * g, so a wrong gradient scale would show (see the 2-process test)
    # and clipping is off, since rescaling to norm 1 would hide a scale error as well
    base_config = merge(
        base_config,
        optimizer={"lr": 0.5, "eps": 1.0, "weight_decay": 0.0},
        deepspeed={"gradient_clipping": 0.0},
    )
    one = merge(base_config, train_iters=1, micro_batch_size=4)
    two = merge(
        base_config,
        train_iters=1,
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        logger={"output_dir": base_config["logger"]["output_dir"] + "-gas"},
    )
    first = weights(train(one).model)
    second = weights(train(two).model)
    initial = weights(
        AutoModelForCausalLM.from_pretrained(base_config["model"]["name_or_path"], dtype=torch.float32)
    )
    assert max_diff(first, initial) > 1e-3  # the step really changed the weights
    assert max_diff(first, second) < 1e-5


def test_packed_training_runs_and_reports(base_config, capsys) -> None:
    config = merge(
        base_config, micro_batch_size=1, train_iters=3, data={"pack_samples": True, "max_length": 256}
    )
    result = train(config)
    assert result.state.step == 3
    out = capsys.readouterr().out
    assert "packed into" in out and "sequences" in out


def test_padding_free_batches_learn_what_padded_batches_learn(base_config, tiny_tokenizer) -> None:
    from posttrain.config import ConfigError, load_config

    config = merge(base_config, train_iters=4, data={"max_length": 128})
    padded = train(config).state.history
    flat_config = merge(config, data={"padding_free": True})
    flat = train(flat_config).state.history
    assert [r["loss"] for r in flat] == pytest.approx([r["loss"] for r in padded], abs=1e-5)
    assert [r["tokens"] for r in flat] == [r["tokens"] for r in padded]
    # one row per micro-batch, no padding, positions restarting per sample, first labels ignored
    samples = [format_sft(row, tiny_tokenizer) for row in chat_rows(3, seed=5)]
    batch = Collator(tiny_tokenizer.pad_token_id, padding_free=True)(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert batch["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in batch
    starts = [sum(lengths[:i]) for i in range(3)]
    assert (batch["position_ids"][0] == 0).nonzero().squeeze(1).tolist() == starts
    assert all(batch["labels"][0, s] == -100 for s in starts)
    padded_batch = Collator(tiny_tokenizer.pad_token_id)(samples)
    assert batch["num_target_tokens"] == padded_batch["num_target_tokens"]
    for clash in ({"data": {"padding_free": True, "pack_samples": True}, "micro_batch_size": 1},):
        with pytest.raises(ConfigError, match="padding_free"):
            load_config(data=merge(config, **clash))
