"""The FLOPs behind ``tflops``/``mfu`` and ``hardware_tflops``/``hfu``, checked against a hand count."""

from __future__ import annotations

import pytest
import torch

from posttrain.tracking.flops import flops_model, peak_for_device_name, peak_tflops
from posttrain.tracking.system import StepMeter, Timers


def _hand_count(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> tuple[int, int]:
    """Non-embedding parameters (head included) and the head's, counted from the LLaMA layout."""
    head_dim = hidden // heads
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * ffn
    norms = 2 * hidden
    head = vocab * hidden
    return layers * (attention + mlp + norms) + hidden + head, head  # + the final norm


@pytest.mark.parametrize("tied", [False, True])
def test_model_and_hardware_flops_equal_a_hand_count(tied: bool) -> None:
    from posttrain.tiny_model import build_model

    model = build_model(1024)  # hidden 64, 2 layers, 4 heads over 2 key/value heads, FFN 256
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    parameters, head = _hand_count(1024, 64, 2, 4, 2, 256)
    flops = flops_model(model, recompute=True)
    assert (flops.parameters, flops.head_parameters, flops.layers, flops.attention_width) == (
        parameters,
        head,
        2,
        64,
    )
    documents = [100, 28, 400]  # one packed row of three documents
    tokens, square = sum(documents), sum(n * n for n in documents)
    model_flops = 6 * parameters * tokens + 6 * 2 * 64 * square
    assert flops.model_flops(tokens, square) == model_flops
    recomputed = 2 * (parameters - head) * tokens + 2 * 2 * 64 * square
    assert flops.hardware_flops(tokens, square) == model_flops + recomputed
    assert flops_model(model, recompute=False).hardware_flops(tokens, square) == model_flops

    meter = StepMeter(torch.device("cpu"), Timers(False, torch.device("cpu")), flops, 100.0, world_size=2)
    out = meter.measure(samples=3, input_tokens=tokens, attention_sq=square, elapsed=0.5)
    assert out["tflops"] == pytest.approx(model_flops / 0.5 / 2 / 1e12)
    assert out["mfu"] == pytest.approx(out["tflops"] / 100.0)
    assert out["hfu"] == pytest.approx(out["hardware_tflops"] / 100.0) and out["hfu"] > out["mfu"]


def test_peak_table_covers_the_common_gpus_by_name() -> None:
    assert peak_for_device_name("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_for_device_name("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_for_device_name("NVIDIA H100 PCIe") == 756.0
    assert peak_for_device_name("NVIDIA H200") == 989.4
    assert peak_for_device_name("NVIDIA B200") == 2250.0
    assert peak_for_device_name("AMD Instinct MI300X") == 1307.4
    assert peak_for_device_name("Some New GPU") is None
    assert peak_tflops(123.0, torch.device("cpu"), torch.float32) == 123.0  # metrics.peak_tflops wins
    assert peak_tflops(None, torch.device("cpu"), torch.bfloat16) is None
