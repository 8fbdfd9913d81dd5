"""A default posttrain run takes the same steps as a hand-written PyTorch loop on the same batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.testing.bare_loop import bare_loop
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stage", [0, 2])
def test_defaults_match_the_bare_loop_step_by_step(base_config, stage, monkeypatch) -> None:
    # posttrain's defaults: activation checkpointing on, linear schedule with warmup, clipping (set low so
    # that it acts on every step), weight decay; stage 2 on one process runs as stage 0 (said in the log)
    config = merge(
        base_config,
        model={"disable_activation_checkpoint": False},
        scheduler={"name": "linear", "warmup_ratio": 0.25},
        optimizer={"lr": 3e-3, "weight_decay": 0.1},
        deepspeed={"gradient_clipping": 0.05, "zero_optimization": {"stage": stage}},
        train_iters=4,
    )
    layer_calls = []
    original = torch.nn.Module.__call__

    def counting(module, *args, **kwargs):
        if type(module).__name__ == "LlamaMLP":
            layer_calls.append(module.training)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", counting)
    result = train(config)
    monkeypatch.undo()
    ours = [record["loss"] for record in result.state.history]
    reference = bare_loop(load_config(data=config), 4).losses
    assert all(record["grad_norm"] > 0.05 for record in result.state.history)  # clipping acted
    assert ours == pytest.approx(reference, abs=1e-6), (ours, reference)
    # trained in training mode, each layer run twice per step: forward, then recomputed in backward
    assert len(layer_calls) == 4 * 2 * 2 and all(layer_calls)


def test_bf16_takes_float32_masters_and_accumulation_like_the_mixed_precision_loop(base_config) -> None:
    """bfloat16 on one process runs DeepSpeed's BF16_Optimizer (float32 master weights, float32 gradient
    accumulation, one optimizer step over flat buffers): the same steps as the bare loop's standard mixed
    precision (bfloat16 weights compute, float32 masters take the update).

    Unclipped, the losses agree to float32 rounding (the two sum the loss in another order); a 16-bit
    optimizer without masters is 5e-4 off at step 2, 2e-3 at step 3 (measured). Clipped, DeepSpeed sums the
    gradient norm in another order than torch's ``clip_grad_norm_`` (an ulp apart), which moves the float32
    masters by an ulp and may flip the bfloat16 rounding of a few weights (on a CPU with AMX, 2e-4 on the
    loss at step 3, measured; 0 without AMX): there the norms agree to 1e-4 (5e-5 at step 3, measured), the
    losses to 5e-4, and clipping is seen to act (the losses move from the unclipped run's several times more)."""
    losses = {}
    norms: list[float] = []
    clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def recording(params, max_norm, **kwargs):  # the bare loop's norm, before it clips
        norms.append(float(clip_grad_norm(params, max_norm, **kwargs)))
        return norms[-1]

    for clip in (0.0, 0.05):
        config = merge(
            base_config,
            model={"dtype": "bfloat16", "disable_activation_checkpoint": False},
            scheduler={"name": "linear", "warmup_ratio": 0.25},
            optimizer={"lr": 3e-3, "weight_decay": 0.1},
            deepspeed={"gradient_clipping": clip},
            train_iters=4,
        )
        config["logger"]["output_dir"] += f"-clip{clip}"
        norms.clear()
        result = train(config)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
            reference = bare_loop(load_config(data=config), 4).losses
        ours = [record["loss"] for record in result.state.history]
        losses[clip] = ours, reference
        assert ours[-1] < ours[0]
        log = (Path(config["logger"]["output_dir"]) / "logs" / "rank-0.log").read_text()
        assert "runs as DeepSpeed's BF16_Optimizer" in log
        if clip == 0:
            assert ours == pytest.approx(reference, rel=1e-6), (ours, reference)
        else:
            ours_norms = [record["grad_norm"] for record in result.state.history]
            assert ours_norms == pytest.approx(norms, rel=1e-4), (ours_norms, norms)
            assert min(norms) > clip  # clipping acts on every step
            assert ours == pytest.approx(reference, abs=5e-4), (ours, reference)
    (clipped, clipped_reference), (unclipped, _) = losses[0.05], losses[0.0]
    off = max(abs(a - b) for a, b in zip(clipped, clipped_reference, strict=True))
    moved = max(abs(a - b) for a, b in zip(clipped, unclipped, strict=True))
    assert moved > 3 * off, (clipped, unclipped, clipped_reference)
