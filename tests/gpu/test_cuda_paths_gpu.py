"""The CUDA paths that CPU tests run only over stand-in kernels (tests/integration/test_cuda_paths_on_cpu.py),
on a real GPU: packed bf16 rows trained through the loop with one varlen call per layer and DeepSpeed's
BF16_Optimizer, compiled bf16 blocks equal to eager with no graph break, and no host sync over a whole forward
and backward."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.data.collate import Collator, HostPrepared, to_device
from posttrain.data.packing import join_samples
from posttrain.models import document_attention
from posttrain.models.document_attention import use_document_attention
from posttrain.models.token_logps import row_nll
from posttrain.tiny_model import build_model
from tests.compile_helpers import assert_few_graphs, eager_and_compiled
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.gpu


@pytest.fixture
def varlen_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    real = document_attention._varlen_attn()
    if real is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    calls: list[int] = []

    @functools.wraps(real)  # posttrain reads its signature to call it
    def counting(*args: Any, **kwargs: Any) -> Any:
        # a constant: appending a traced size would make the compiler specialise on it and recompile for
        # every new row length (8 graphs over 7 steps on an H100, 2026-11-26)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(document_attention, "_varlen_attn", lambda: counting)
    return calls


def _batch(count: int, total: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 400, size=count)
    lengths = (lengths * total / lengths.sum()).astype(int)
    lengths[-1] += total - lengths.sum()
    samples = [
        {"input_ids": rng.integers(5, 1000, n).tolist(), "labels": rng.integers(5, 1000, n).tolist()}
        for n in lengths
    ]
    return to_device(HostPrepared(Collator(0))([join_samples(samples)]), torch.device("cuda"))


def test_packed_bf16_rows_train_through_the_loop(base_config: dict, varlen_calls: list[int]) -> None:
    config = merge(
        base_config,
        train_iters=12,
        micro_batch_size=1,
        optimizer={"lr": 3e-3},
        model={"dtype": "bfloat16", "disable_activation_checkpoint": False},
        data={"pack_samples": True, "max_length": 256},
    )
    result = train(config)
    history = result.state.history
    assert history[-1]["loss"] < history[0]["loss"]
    layers = result.model.config.num_hidden_layers
    assert len(varlen_calls) >= 12 * layers  # every packed step, every layer, one call (plus recomputation)
    log = (Path(config["logger"]["output_dir"]) / "logs" / "rank-0.log").read_text()
    assert "BF16_Optimizer" in log


def test_compiled_bf16_packed_blocks_equal_eager(
    varlen_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the counting wrapper's append is a side effect inside checkpointed compiled blocks: allowed (it is not
    # replayed by the recomputation), so the count does not itself break the graph
    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", True)
    model = build_model(1024, hidden_size=256, heads=4, max_position_embeddings=4096, seed=2)
    eager, compiled = eager_and_compiled(model.cuda().bfloat16().train())
    for step in range(7):
        batch = _batch(8 + step, 2048 + 128 * step, seed=step)
        losses = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = row_nll(model, batch).sum() / batch["num_target_tokens"]
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 2e-2, (step, losses)
    assert_few_graphs()
    assert varlen_calls


@pytest.mark.parametrize("tiled", [False, True])
def test_no_host_sync_over_a_whole_forward_and_backward(varlen_calls: list[int], tiled: bool) -> None:
    model = build_model(1024, hidden_size=256, heads=4, max_position_embeddings=4096, seed=3)
    model = model.cuda().bfloat16().train()
    use_document_attention(model)
    batch = _batch(16, 4096, seed=9)
    row_nll(model, batch, tiled).sum().backward()  # warm-up: allocator, kernels chosen
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        row_nll(model, batch, tiled).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert varlen_calls
