"""Long-sequence paths on a GPU: the liger factory (Triton kernels, fused linear cross-entropy), the tiled
loss in bf16, and the checkpoint offload into pinned host memory."""

from __future__ import annotations

import pytest
import torch

from posttrain.data.samples import IGNORE_INDEX
from posttrain.methods.sft import sft_loss
from posttrain.models.memory import OffloadCounter, apply_activation_checkpointing
from posttrain.tiny_model import build_model
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.gpu


def _batch(length: int = 256) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 512, (2, length), generator=torch.Generator().manual_seed(0)).cuda()
    labels = ids.clone()
    labels[:, : length // 3] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def test_liger_factory_trains_and_its_fused_loss_matches_the_tiled_loss(base_config: dict) -> None:
    pytest.importorskip("liger_kernel")
    from posttrain.models.liger import _liger, fused_linear_nll

    model = build_model(512, hidden_size=128, heads=4).cuda().train()
    batch = _batch()
    plain = sft_loss(model, batch, tiled=True)[0]
    model.posttrain_fused_head_nll = fused_linear_nll(_liger())
    fused = sft_loss(model, batch, tiled=True)[0]
    assert abs(float(plain) - float(fused)) <= 1e-3 * abs(float(plain))

    config = merge(
        base_config,
        train_iters=15,
        optimizer={"lr": 3e-3},
        tiled_loss_compute=True,
        model={"type": "liger", "dtype": "bfloat16", "disable_activation_checkpoint": False},
        logger={"output_dir": base_config["logger"]["output_dir"] + "-liger"},
    )
    result = train(config)
    history = result.state.history
    assert history[-1]["loss"] < history[0]["loss"]


def test_tiled_loss_in_bf16_matches_the_plain_loss() -> None:
    model = build_model(512, hidden_size=128, heads=4).cuda().to(torch.bfloat16).train()
    batch = _batch(1024)
    plain = float(sft_loss(model, batch, tiled=False)[0])
    tiled = float(sft_loss(model, batch, tiled=True)[0])
    assert abs(plain - tiled) <= 1e-2 * abs(plain)


def test_checkpoint_offload_stores_layer_inputs_in_pinned_host_memory() -> None:
    model = build_model(512, hidden_size=128, heads=4).cuda().train()
    apply_activation_checkpointing(model, True, offload=True)
    before = OffloadCounter.stored
    loss, _ = sft_loss(model, _batch())
    loss.backward()
    assert OffloadCounter.stored - before == 2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
