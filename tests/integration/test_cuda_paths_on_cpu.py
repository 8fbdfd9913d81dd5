"""The CUDA paths of per-document attention, run on the CPU over stand-in kernels (tests/varlen_stand_ins.py):
the varlen call as each torch version's signature asks, sliding windows and autocast on the varlen path, the
compiled bf16 packed path through backward, and no device read over a whole forward and backward."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.data.collate import Collator, HostPrepared
from posttrain.data.packing import join_samples
from posttrain.models import document_attention
from posttrain.models.document_attention import per_document, use_document_attention
from posttrain.models.sequence_parallel import SequenceSlicer
from posttrain.models.token_logps import row_nll
from posttrain.tiny_model import build_model
from tests import varlen_stand_ins as stand_ins
from tests.compile_helpers import assert_few_graphs, eager_and_compiled
from tests.device_reads import DeviceReads

pytestmark = pytest.mark.integration


def _samples(count: int, total: int, seed: int = 0, short: int = 8) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(short, 120, size=count)
    lengths = (lengths * total / lengths.sum()).astype(int)
    lengths[-1] += total - lengths.sum()
    return [
        {"input_ids": rng.integers(5, 1000, n).tolist(), "labels": rng.integers(5, 1000, n).tolist()}
        for n in lengths
    ]


def _packed(count: int = 12, total: int = 600, seed: int = 0) -> dict[str, Any]:
    return HostPrepared(Collator(0))([join_samples(_samples(count, total, seed))])


def _qkv(tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """``[1, heads, tokens, dim]``: 4 query heads over 2 key/value heads, head size 16."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, tokens, 16, generator=generator).to(dtype)
    key, value = (torch.randn(1, 2, tokens, 16, generator=generator).to(dtype) for _ in range(2))
    return query, key, value


def _expected(query: Any, key: Any, value: Any, bounds: Any, scale: float, window: int = 0) -> torch.Tensor:
    """float32 causal attention per document, in transformers' output layout ``[1, tokens, heads, dim]``."""
    flat = (x[0].transpose(0, 1) for x in (query, key, value))
    out = stand_ins.reference(*flat, bounds.to(torch.int32), scale, window - 1 if window else -1)
    return out.unsqueeze(0).float()


@pytest.mark.parametrize("version", sorted(stand_ins.SIGNATURES))
def test_each_torch_signature_runs_every_document_in_one_call(version: str) -> None:
    batch = _packed()
    query, key, value = _qkv(batch["input_ids"].shape[1])
    attention = per_document(lambda *a, **k: pytest.fail("the whole-row core ran"))
    scale = 16**-0.5
    inputs = {k: batch[k] for k in ("document_bounds", "cu_seq_lens_q", "max_length_q")}
    with stand_ins.varlen_on_cpu(stand_ins.SIGNATURES[version]):
        out, _ = attention(None, query, key, value, None, scaling=scale, **inputs)
        calls = list(stand_ins.CALLS)
        # 2.10 takes no scale: another scale keeps to the per-document sdpa loop, which is as exact
        other, _ = attention(None, query, key, value, None, scaling=0.2, **inputs)
        other_calls = list(stand_ins.CALLS[len(calls) :])
    assert calls == [version]
    assert other_calls == ([] if version == "2.10" else [version])
    expected = _expected(query, key, value, batch["document_bounds"], scale)
    assert torch.allclose(out.float(), expected, atol=1e-2)
    assert torch.allclose(
        other.float(), _expected(query, key, value, batch["document_bounds"], 0.2), atol=1e-2
    )


def _mistral(window: int) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=window,
    )
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("varlen", [False, True])
def test_sliding_windows_run_per_document_and_equal_the_masked_row(varlen: bool) -> None:
    """Mistral with a 24-token window over documents of 8 to ~110 tokens: some fit inside the window, some
    do not; both paths give transformers' own masked row (sliding window and document mask)."""
    model = _mistral(24)
    batch = _packed(seed=1)
    assert batch["max_length_q"] > 24 > min(np.diff(batch["document_bounds"].numpy()))
    masked = copy.deepcopy(model)
    masked.set_attn_implementation("sdpa")
    keep = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    if varlen:
        model, masked = model.bfloat16(), masked.bfloat16()
    reference = row_nll(masked, keep)
    assert use_document_attention(model) == ""
    with stand_ins.varlen_on_cpu(stand_ins.varlen_2_13 if varlen else None):
        ours = row_nll(model, batch)
        assert len(stand_ins.CALLS) == (2 if varlen else 0)  # one call per layer
    assert torch.allclose(ours, reference, rtol=2e-2 if varlen else 1e-5)


def test_left_padded_prompts_longer_than_the_window_attend_without_their_padding() -> None:
    """Generation's left-padded prompts on a sliding-window model switched to per-document attention: each
    real position's logits are the prompt's alone (a row is never taken as one causal document when padding
    comes first: that attended the padding, 1.2e-2 off), and transformers' ``generate`` through the trainer's
    engine gives each prompt's greedy completion alone."""
    from posttrain.generation.transformers_engine import TransformersEngine
    from posttrain.generation.types import Sampling

    model = _mistral(8)
    assert use_document_attention(model) == ""
    prompts = [list(range(3, 23)), list(range(40, 52))]  # 20 and 12 tokens: the second gets 8 of padding
    ids = torch.tensor([prompts[0], [0] * 8 + prompts[1]])
    mask = (torch.arange(20) >= torch.tensor([[0], [8]])).long()
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        for row, (prompt, pad) in enumerate(zip(prompts, (0, 8), strict=True)):
            alone = model(input_ids=torch.tensor([prompt])).logits[0]
            assert torch.allclose(batch[row, pad:], alone, atol=1e-5, rtol=0), row
            own = model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=[2]
            )
            engine = TransformersEngine([2], 0).generate(model, prompts, Sampling(max_new_tokens=6), None)
            assert engine.ids[row] == own[0, len(prompt) :].tolist(), row


def test_models_whose_attention_is_more_than_windowed_causal_keep_the_masked_row() -> None:
    model = _mistral(4096)
    model.config.attention_dropout = 0.1
    assert use_document_attention(model) == "its attention_dropout is 0.1"
    assert model.config._attn_implementation != document_attention.DOCUMENT_ATTENTION


def test_autocast_float32_inputs_take_the_varlen_path() -> None:
    """fp32 weights under bf16 autocast: RoPE hands attention fp32 tensors; they are cast as autocast would
    cast them for sdpa, and the documents run in one varlen call."""
    batch = _packed()
    query, key, value = _qkv(batch["input_ids"].shape[1], torch.float32)
    attention = per_document(lambda *a, **k: pytest.fail("the whole-row core ran"))
    inputs = {k: batch[k] for k in ("document_bounds", "cu_seq_lens_q", "max_length_q")}
    with stand_ins.varlen_on_cpu(stand_ins.varlen_2_13), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(None, query, key, value, None, scaling=0.25, **inputs)
    assert stand_ins.CALLS == ["2.13"] and out.dtype == torch.bfloat16
    expected = _expected(query, key, value, batch["document_bounds"], 0.25)
    assert torch.allclose(out.float(), expected, atol=2e-2)


# ---------------------------------------------------------------------- torch's own operators, compiled


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = row_nll(model, batch).sum() / batch["num_target_tokens"]
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _without_bounds(batch: dict[str, Any]) -> dict[str, Any]:
    """A packed row as a user's code might pass it: ids, labels and positions only."""
    return {k: batch[k] for k in ("input_ids", "labels", "position_ids", "num_target_tokens")}


def test_compiled_bf16_packed_blocks_train_through_backward_with_torchs_varlen() -> None:
    """torch's ``varlen_attn`` and its autograd registration over stand-in kernels, inside compiled blocks
    with activation checkpointing: changing bounds compile into few graphs with no break, and every step's
    loss and gradients equal the eager model's, also for a row given without its bounds (the model derives
    them before its compiled blocks, which would otherwise attend across documents)."""
    if not stand_ins.register_torch_kernels():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    eager, compiled = eager_and_compiled(
        build_model(1024, hidden_size=64, heads=4, seed=2).bfloat16().train()
    )
    kernels: set[str] = set()
    with stand_ins.varlen_on_cpu():
        for step in range(3):
            batch = _packed(count=6 + step, total=400 + 40 * step, seed=step)
            reference = _loss_and_grads(eager, batch)
            stand_ins.CALLS.clear()
            # the last step's row comes without bounds (a user's call): derived before the compiled blocks
            given = _without_bounds(batch) if step == 2 else batch
            ours = _loss_and_grads(compiled, given)
            kernels.update(stand_ins.CALLS)  # what the compiled blocks ran
            assert abs(reference[0] - ours[0]) < 1e-2, step
            for name, grad in reference[1].items():
                assert torch.allclose(grad, ours[1][name], rtol=5e-2, atol=5e-3), (step, name)
    assert kernels == {"torch_attn::_varlen_attn", "torch_attn::_varlen_attn_backward"}
    assert_few_graphs()


# ------------------------------------------------------------------------------------ no device read


def _user_collator(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A user's collator: one packed row with positions, and nothing else."""
    row = join_samples(samples)
    ids = torch.tensor([row["input_ids"]])
    return {
        "input_ids": ids,
        "labels": torch.tensor([row["labels"]]),
        "position_ids": torch.tensor([row["position_ids"]]),
        "num_target_tokens": int((torch.tensor(row["labels"])[1:] != -100).sum()),
    }


BATCHES = {
    "packed": lambda s: HostPrepared(Collator(0))([join_samples(s)]),
    "padding-free": lambda s: HostPrepared(Collator(0, padding_free=True))(s),
    "user collator": lambda s: HostPrepared(_user_collator)(s),
    "sequence parallel, unpacked": lambda s: HostPrepared(SequenceSlicer(Collator(0), 0, 2, 0, rows=1))(
        s[:1]
    ),
}


@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("varlen", [False, True])
def test_no_device_read_over_a_whole_forward_and_backward(kind: str, varlen: bool) -> None:
    """Every row that holds documents brings their bounds, so no layer reads the device; the tiled loss
    takes the labelled positions from the host."""
    batch = BATCHES[kind](_samples(8, 500, seed=4))
    assert "document_bounds" in batch and "target_rows" in batch
    model = build_model(1024, hidden_size=64, heads=4, seed=3)
    model = model.bfloat16() if varlen else model
    use_document_attention(model)
    with stand_ins.varlen_on_cpu(stand_ins.varlen_2_13 if varlen else None):
        for tiled in (False, True):
            # the stand-in kernel reads the cumulative lengths on the host; a GPU kernel reads them itself
            mode = DeviceReads([batch["document_bounds"], batch["cu_seq_lens_q"]])
            with mode:
                row_nll(model, batch, tiled).sum().backward()
            assert mode.reads == [] and mode.copies == [], (tiled, mode.reads, mode.copies)
        documents = len(batch["document_bounds"]) > 2  # one document (the unpacked row): plain causal sdpa
        assert len(stand_ins.CALLS) == (4 if varlen and documents else 0)


def test_the_sync_check_sees_a_device_read() -> None:
    """The check itself: without the host's target rows the tiled loss finds them with ``nonzero``."""
    batch = _packed()
    del batch["target_rows"]
    model = build_model(1024, hidden_size=64, heads=4, seed=3)
    use_document_attention(model)
    mode = DeviceReads([batch["document_bounds"]])
    with mode:
        row_nll(model, batch, True).sum().backward()
    assert "nonzero" in mode.reads


WAITS = {
    "int": (lambda step, host: int(step[0]), "__int__"),
    "float": (lambda step, host: float(step.sum()), "__float__"),
    "cpu": (lambda step, host: step.cpu(), "cpu"),
    "to another device": (lambda step, host: step.to("cpu"), "to"),
    "to another tensor's device": (lambda step, host: step.to(host), "to"),
    "boolean mask": (lambda step, host: step[step > 0], "boolean mask"),
    "item": (lambda step, host: step.max().item(), "item"),
}
COPIES = {
    "to the device": lambda step, host: host.to(step.device),
    "to(device=...)": lambda step, host: host.to(device=step.device, non_blocking=True),
    "tensor onto the device": lambda step, host: torch.tensor([1, 2], device=step.device),
}


@pytest.mark.parametrize("kind", sorted(WAITS))
def test_the_sync_check_sees_each_read(kind: str) -> None:
    step, host = torch.arange(6.0) - 2, torch.arange(3)
    do, expected = WAITS[kind]
    with DeviceReads([host]) as mode:
        do(step, host)
        host.tolist(), int(host[0]), host[host > 0], (host + 1).max().item()  # the host's own: no wait
        step.to(torch.float64)  # a conversion on the device: no wait
    assert mode.reads == [expected] and mode.copies == []


@pytest.mark.parametrize("kind", sorted(COPIES))
def test_the_sync_check_sees_each_host_to_device_copy(kind: str) -> None:
    step, host = torch.arange(6.0), torch.arange(3)
    with DeviceReads([host]) as mode:
        COPIES[kind](step, host)
    assert mode.copies == [kind.split(" ")[0].split("(")[0]] and mode.reads == []


def test_rows_without_bounds_are_read_once_per_forward_not_per_layer() -> None:
    """A packed row given with positions only (a user's call): the model derives the bounds before its
    layers, one read of the positions and one copy of the bounds per forward, whatever the layer count."""
    batch = _without_bounds(_packed())
    model = build_model(1024, hidden_size=64, heads=4, layers=3, seed=3)
    use_document_attention(model)
    reference = row_nll(model, _packed()).detach()
    with DeviceReads() as mode:
        ours = row_nll(model, batch)
        ours.sum().backward()
    assert mode.reads == ["nonzero", "tolist"] and mode.copies == ["to"], (mode.reads, mode.copies)
    assert torch.allclose(ours.detach(), reference, atol=1e-5)


def test_positions_changed_in_place_are_read_afresh() -> None:
    """Bounds are derived for every forward, never kept on the positions tensor: after an in-place write to
    the positions the logits are those of the new documents."""
    model = build_model(1024, hidden_size=64, heads=4, seed=3).eval()
    use_document_attention(model)
    batch = _without_bounds(_packed())
    positions = batch["position_ids"]
    inputs = {"input_ids": batch["input_ids"], "position_ids": positions, "use_cache": False}
    with torch.no_grad():
        model(**inputs)
        other = _without_bounds(_packed(count=5, seed=7))["position_ids"]
        positions.copy_(other)  # the same tensor, other documents
        changed = model(**inputs).logits
        fresh = model(**{**inputs, "position_ids": other.clone()}).logits
    assert torch.equal(changed, fresh)
