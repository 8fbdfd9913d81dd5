"""Long-sequence features on one process: the tiled loss, the tiled MLP and the activation offload change
where activations live, never the loss or a gradient."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from posttrain.data.samples import IGNORE_INDEX
from posttrain.errors import UserError
from posttrain.methods.dpo import pair_logps
from posttrain.methods.sft import sft_loss
from posttrain.models import token_logps
from posttrain.models.memory import OffloadCounter, apply_activation_checkpointing, tile_mlps
from posttrain.models.sequence_parallel import SequenceSlicer
from posttrain.tiny_model import build_model

pytestmark = pytest.mark.integration


def _model(**kwargs: Any) -> torch.nn.Module:
    return build_model(96, hidden_size=32, layers=2, heads=4, **kwargs).train()


def _batch(rows: int = 3, length: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (rows, length), generator=generator)
    labels = ids.clone()
    labels[:, : length // 2] = IGNORE_INDEX  # a prompt
    labels[1] = IGNORE_INDEX  # a row with nothing to learn
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _accumulate(model: torch.nn.Module, tiled: bool, scales: tuple[float, ...]) -> tuple[float, dict]:
    """Micro-batches whose summed losses are scaled before backward as the loop does (per target token of
    the step, times a factor standing for the ranks DeepSpeed averages over)."""
    model.zero_grad()
    batches = [_batch(seed=seed) for seed in range(len(scales))]
    tokens = sum(int((token_logps.target_labels(b) != IGNORE_INDEX).sum()) for b in batches)
    total = 0.0
    for batch, scale in zip(batches, scales, strict=True):
        loss, _ = sft_loss(model, batch, tiled)
        (loss * scale / tokens).backward()
        total += float(loss.detach()) / tokens
    return total, _grads(model)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_tiled_loss_equals_the_plain_loss_with_scaling_and_empty_rows(monkeypatch) -> None:
    monkeypatch.setattr(token_logps, "chunk_rows", lambda *sizes: 7)  # many chunks on a short batch
    model = _model()
    plain, plain_grads = _accumulate(model, False, (0.37, 1.9))
    tiled, tiled_grads = _accumulate(model, True, (0.37, 1.9))
    assert abs(plain - tiled) <= 1e-6 * abs(plain)
    assert "lm_head.weight" in tiled_grads
    assert _max_diff(plain_grads, tiled_grads) <= 1e-6
    # the head is back to normal afterwards: logits again
    assert model(input_ids=_batch()["input_ids"]).logits.shape[-1] == 96


def test_tiled_loss_of_a_batch_without_labels_is_zero_and_finite() -> None:
    model = _model()
    batch = _batch()
    batch["labels"][:] = IGNORE_INDEX
    loss, _ = sft_loss(model, batch, True)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(
        torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters() if p.grad is not None
    )


def test_dpo_log_probabilities_use_the_same_chunking(monkeypatch) -> None:
    monkeypatch.setattr(token_logps, "chunk_rows", lambda *sizes: 5)
    model = _model()
    batch = _batch(rows=4)
    batch["labels"][1] = batch["input_ids"][1]
    plain = pair_logps(model, batch, False)
    tiled = pair_logps(model, batch, True)
    for a, b in zip(plain, tiled, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-6), (a, b)


def test_auto_tiles_long_micro_batches_only(monkeypatch) -> None:
    model = _model()
    monkeypatch.setattr(token_logps, "TILED_LOSS_MIN_TOKENS", 100)
    assert token_logps.use_tiled("auto", _batch(rows=3, length=40), model)
    assert not token_logps.use_tiled("auto", _batch(rows=2, length=40), model)


def test_tiled_mlp_equals_the_plain_mlp() -> None:
    plain_model, tiled_model = _model(), _model()
    assert tile_mlps(tiled_model) == 2
    batch = _batch(length=200)  # hidden 32: 7 tiles
    plain, plain_grads = _accumulate_batch(plain_model, batch)
    tiled, tiled_grads = _accumulate_batch(tiled_model, batch)
    assert abs(plain - tiled) <= 1e-6 * abs(plain)
    assert _max_diff(plain_grads, tiled_grads) <= 1e-6


def _accumulate_batch(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict]:
    model.zero_grad()
    loss, _ = sft_loss(model, batch)
    tokens = int((token_logps.target_labels(batch) != IGNORE_INDEX).sum())
    (loss / tokens).backward()
    return float(loss.detach()) / tokens, _grads(model)


def test_tiled_mlp_refuses_other_mlp_shapes() -> None:
    model = _model()
    for layer in model.model.layers:
        del layer.mlp.gate_proj  # no longer a gated MLP
    with pytest.raises(UserError, match=r"LlamaForCausalLM has LlamaMLP.*tiled_mlp_compute: false"):
        tile_mlps(model)


def test_checkpoint_offload_runs_once_per_layer_and_keeps_the_gradients() -> None:
    checkpointed, offloaded = _model(), _model()
    apply_activation_checkpointing(checkpointed, True)
    apply_activation_checkpointing(offloaded, True, offload=True)
    batch = _batch()
    reference, reference_grads = _accumulate_batch(checkpointed, batch)
    before = OffloadCounter.stored
    loss, grads = _accumulate_batch(offloaded, batch)
    assert OffloadCounter.stored - before == 2  # one layer input per decoder layer, per forward
    assert abs(loss - reference) <= 1e-6 * abs(reference)
    assert _max_diff(reference_grads, grads) <= 1e-6


def test_sequence_slicer_pads_shifts_and_counts_each_slice() -> None:
    from posttrain.data.collate import Collator

    labels = [IGNORE_INDEX] * 6 + [5, 6, 7]  # the only labels sit in the second half
    sample = {"input_ids": list(range(1, 10)), "labels": labels}
    halves = [SequenceSlicer(Collator(0), 0, 2, rank, rows=2)([sample]) for rank in (0, 1)]
    for half in halves:
        assert half["input_ids"].shape == (2, 5)  # 9 tokens padded to 10, one row padded to 2
        assert "labels" not in half and "attention_mask" not in half
    assert halves[0]["num_target_tokens"] == 0 and halves[1]["num_target_tokens"] == 3
    assert torch.equal(
        torch.cat([halves[0]["shift_labels"][0], halves[1]["shift_labels"][0]]),
        torch.tensor([IGNORE_INDEX] * 5 + [5, 6, 7, IGNORE_INDEX, IGNORE_INDEX]),
    )
    assert torch.equal(torch.cat([h["position_ids"][0] for h in halves]), torch.arange(10))
    assert [h["num_input_tokens"] for h in halves] == [5, 4]
    assert [h["num_samples"] for h in halves] == [1, 0]


def test_liger_factory_without_a_gpu_says_so(base_config: dict) -> None:
    from posttrain.config import load_config
    from posttrain.context import RunContext
    from posttrain.dist import DistInfo
    from posttrain.registry import MODEL_FACTORIES

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    config = load_config(data={**base_config, "model": {**base_config["model"], "type": "liger"}})
    ctx = RunContext(config, DistInfo(0, 0, 1, torch.device("cpu")))
    with pytest.raises(UserError, match=r"need a CUDA GPU.*model.type: huggingface"):
        MODEL_FACTORIES.get("liger").obj(config.model, ctx)


def test_the_model_factory_reports_the_facts_the_run_needs(tiny_model_dir) -> None:
    from posttrain.config.model import ModelConfig
    from posttrain.models.facts import facts_from_model
    from posttrain.registry import MODEL_FACTORIES

    factory = MODEL_FACTORIES.get("huggingface").obj
    facts = factory.facts(ModelConfig(name_or_path=str(tiny_model_dir)))
    assert facts is not None
    assert (facts.hidden_size, facts.max_positions, facts.attention_heads, facts.kv_heads) == (64, 1024, 4, 2)
    assert facts.architecture == "LlamaForCausalLM" and facts.gated_mlp is None  # not known before building
    built = facts_from_model(_model(), facts)
    assert built is not None and built.mlp == ("LlamaMLP",) and built.gated_mlp is True
    assert factory.facts(ModelConfig(name_or_path=str(tiny_model_dir / "missing"))) is None


def test_sequence_parallel_start_up_checks_say_what_to_change() -> None:
    from posttrain.config import load_config
    from posttrain.config.sequence_parallel import check_model as check_sequence_parallel
    from posttrain.models.facts import ModelFacts
    from posttrain.plan import data_parallel_size

    facts = ModelFacts("llama", "LlamaForCausalLM", 64, 1024, 6, 3, 96)
    with pytest.raises(UserError, match=r"6 attention heads, not divisible by sequence_parallel_size=4"):
        check_sequence_parallel(4, facts, "sdpa")
    check_sequence_parallel(3, facts, "sdpa")
    config = load_config(
        data={"model": {"name_or_path": "m"}, "data": {"sources": ["x.jsonl"]}, "sequence_parallel_size": 2}
    )
    with pytest.raises(UserError, match=r"must divide the world size 3; run on a multiple of 2"):
        data_parallel_size(config, 3)
    assert data_parallel_size(config, 4) == 2


def test_chunks_match_the_hidden_states_within_bounds() -> None:
    assert token_logps.chunk_rows(32_000, 128, 32_768) == 256  # logits no larger than needed
    assert token_logps.chunk_rows(32_000, 2048, 32_768) == 2098  # as large as the hidden states
    assert token_logps.chunk_rows(128_000, 4096, 131_072) == 2**27 // 128_000  # capped at 512 MiB
