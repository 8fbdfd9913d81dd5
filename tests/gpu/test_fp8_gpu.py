"""``model.fp8`` on a GPU with FP8 matrix units (compute capability 8.9+: Ada, Hopper): the products run on
them (no emulation line), one layer's output is torchao's emulation of the same casts, and a bf16 run with
packed rows trains compiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.helpers import merge, train

pytestmark = pytest.mark.gpu
torchao = pytest.importorskip("torchao")


@pytest.fixture(autouse=True)
def fp8_units() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 matrix units (needs compute capability 8.9)")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_layer_on_the_fp8_units_equals_torchaos_emulation(recipe: str) -> None:
    from posttrain.models.fp8 import choose_layers, convert, emulation_reason

    assert emulation_reason(recipe, torch.device("cuda")) == ""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    models = [
        torch.nn.Sequential(torch.nn.Linear(1024, 2048, bias=False)).cuda().bfloat16() for _ in range(2)
    ]
    for model, emulate in zip(models, (False, True), strict=True):
        model[0].load_state_dict(layer.state_dict())
        convert(model, recipe, choose_layers(model, recipe, []), emulate=emulate)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    real, emulated = (model(x).float() for model in models)
    plain = layer(x).float()
    # the same casts and scales; the units accumulate in their own order (and fast accumulation in forward)
    assert (real - emulated).norm() / emulated.norm() < 2e-2
    assert (real - plain).norm() / plain.norm() < 0.1


def test_a_packed_bf16_run_trains_compiled_on_the_fp8_units(base_config: dict, tmp_path: Path) -> None:
    config = merge(
        base_config,
        train_iters=12,
        micro_batch_size=1,
        optimizer={"lr": 3e-3},
        model={"dtype": "bfloat16", "fp8": "tensorwise", "compile": True},
        data={"pack_samples": True, "max_length": 256},
    )
    result = train(config)
    assert sum(type(m).__name__ == "Float8Linear" for m in result.model.modules()) == 14
    history = result.state.history
    assert history[-1]["loss"] < history[0]["loss"]
    log = (Path(config["logger"]["output_dir"]) / "logs" / "rank-0.log").read_text()
    assert "fp8 tensorwise: 14 linear layers multiply in float8" in log and "emulated" not in log
