"""FP8 training (``model.fp8``): one converted layer against torchao's own scaling and casting, the layers
chosen, the config's checks, the memory plan's casts, the converters' mappings, and a quiet import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.config.fp8 import AUTO_FILTER
from posttrain.memory.estimate import Settings, plan
from posttrain.memory.shape import model_shape
from posttrain.models.fp8 import (
    ADAPTER,
    FILTERED,
    HEAD,
    SHAPE,
    SMALL,
    choose_layers,
    convert,
    emulation_reason,
)

pytest.importorskip("torchao")


def _reference_cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's tensorwise dynamic cast, undone: what the float8 product multiplies."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(tensor, dtype)
    return to_fp8_saturated(tensor * scale, dtype).float() / scale


def test_one_tensorwise_layer_forward_and_backward_equal_torchaos_casts() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    weight = layer.weight.detach().clone()
    model = torch.nn.Sequential(layer)
    chosen = choose_layers(model, "tensorwise", [])
    assert convert(model, "tensorwise", chosen, emulate=True) == 1
    assert type(model[0]).__name__ == "Float8Linear" and model[0].weight.dtype == torch.float32
    x = torch.randn(8, 64, requires_grad=True)
    out = model(x)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    expected = _reference_cast(x.detach(), e4m3) @ _reference_cast(weight, e4m3).t()
    torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=1e-6)
    grad = torch.randn(8, 32)
    out.backward(grad)
    grad_input = _reference_cast(grad, e5m2) @ _reference_cast(weight, e4m3)
    grad_weight = _reference_cast(grad, e5m2).t() @ _reference_cast(x.detach(), e4m3)
    torch.testing.assert_close(x.grad, grad_input, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[0].weight.grad, grad_weight, rtol=1e-6, atol=1e-6)
    # float8 is not the plain product, but close to it (torchao's SQNR measure)
    from torchao.float8.float8_utils import compute_error

    plain = x.detach() @ weight.t()
    assert not torch.equal(out.detach(), plain) and compute_error(plain, out.detach()) > 20


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_row_recipes_equal_torchaos_own_layer(recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import compute_error

    torch.manual_seed(1)
    plain = torch.nn.Linear(64, 48)
    emulated = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    theirs = Float8Linear.from_float(torch.nn.Linear(64, 48), config=emulated)
    theirs.load_state_dict(plain.state_dict())
    ours = torch.nn.Sequential(torch.nn.Linear(64, 48))
    ours[0].load_state_dict(plain.state_dict())
    convert(ours, recipe, choose_layers(ours, recipe, []), emulate=True)
    x = torch.randn(16, 64)
    for module in (theirs, ours):
        module(x).square().sum().backward()
    torch.testing.assert_close(ours[0].weight.grad, theirs.weight.grad)
    assert compute_error(plain(x).detach(), ours(x).detach()) > 20


def _meta_llama(hidden: int = 64, **config) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": 2}
    shape |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500, **config}
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**shape))


def test_the_head_adapters_odd_sizes_and_filtered_names_stay_in_high_precision() -> None:
    from peft import LoraConfig, get_peft_model

    model = _meta_llama()
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(256, 60, bias=False, device="meta")  # 60 % 16
    with torch.device("meta"):
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    layers = choose_layers(model, "tensorwise", ["layers.1.mlp"])
    kept = dict(layers.kept)
    assert kept["base_model.model.lm_head"] == HEAD
    assert kept["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default"] == ADAPTER
    assert kept["base_model.model.model.layers.0.mlp.down_proj"] == SHAPE
    assert {name for name, why in layers.kept if why == FILTERED} == {
        f"base_model.model.model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer" in layers.converted
    assert len(layers.converted) == 7 + 4 - 1  # layer 0: 7 linears, one odd; layer 1: attention only
    line = layers.summary("tensorwise", "bfloat16")
    assert line.startswith("fp8 tensorwise: 10 linear layers multiply in float8")
    assert "left in bfloat16: " in line and "lm_head (the LM head)" in line


def test_auto_filter_small_kn_uses_torchaos_size_rule() -> None:
    big = _meta_llama(hidden=2048, num_attention_heads=16, num_key_value_heads=4, intermediate_size=8192)
    layers = choose_layers(big, "tensorwise", [AUTO_FILTER])
    small = {name.rsplit(".", 1)[-1] for name, why in layers.kept if why == SMALL}
    assert small == {"k_proj", "v_proj"}  # 2048 -> 512: torchao's tensorwise rule leaves K <= 4096, N <= 1024
    assert {name.rsplit(".", 1)[-1] for name in layers.converted} == {
        "q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert choose_layers(big, "tensorwise", []).kept == (("lm_head", HEAD),)


def test_a_cpu_emulates() -> None:
    assert "no FP8 matrix units" in emulation_reason("tensorwise", torch.device("cpu"))


def _config(tmp_path: Path, **model) -> dict:
    return {
        "type": "sft",
        "model": {"name_or_path": str(tmp_path / "m"), **model},
        "data": {"sources": ["rows.jsonl"]},
    }


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (True, "names no recipe; use one of tensorwise, rowwise, rowwise_with_gw_hp"),
        ("rowwize", "did you mean rowwise?"),
        ("mxfp8", "not an FP8 recipe"),
    ],
)
def test_bad_recipes_are_config_errors(tmp_path: Path, value: object, says: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.fp8") as error:
        load_config(data=_config(tmp_path, fp8=value))
    assert says in str(error.value)


def test_what_fp8_cannot_run_with_is_refused_at_validation(tmp_path: Path) -> None:
    quantised = _config(tmp_path, fp8="tensorwise", quantization_config={"load_in_4bit": True})
    quantised["model"]["peft_config"] = {"r": 4}
    with pytest.raises(ConfigError, match=r"model\.fp8: cannot run on a quantised base"):
        load_config(data=quantised)
    dpo = {**_config(tmp_path, fp8="tensorwise"), "type": "dpo"}
    dpo["ref_model"] = {"name_or_path": "ref", "fp8": "tensorwise"}
    with pytest.raises(ConfigError, match=r"ref_model\.fp8: FP8 speeds up training; a frozen model"):
        load_config(data=dpo)


def test_fp8_filter_fqns_without_fp8_is_warned(tmp_path: Path) -> None:
    from posttrain.config.mode_keys import inert_warnings

    config = load_config(data=_config(tmp_path, fp8_filter_fqns=["lm"]))
    assert "model.fp8_filter_fqns has no effect: it is used only with fp8: a recipe" in inert_warnings(config)


def test_the_memory_plan_counts_the_casts(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model(
        "llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "m")  # fmt: skip
    from posttrain.config.model import ModelConfig

    plain = model_shape(ModelConfig(name_or_path=str(tmp_path / "m")))
    shape = model_shape(ModelConfig(name_or_path=str(tmp_path / "m"), fp8="tensorwise"))
    assert plain.fp8 is None and shape.fp8 is not None and len(shape.fp8.converted) == 14
    assert shape.fp8.largest == 256 * 1024 and shape.fp8.widest == 1024
    for device, extra in (("cuda", 0), ("cpu", 4 * (512 * 1024 + 256 * 1024))):
        settings = Settings(dtype="bfloat16", world_size=1, stage=0, micro_batch=1, tokens_per_row=512)
        settings = Settings(**{**settings.__dict__, "device": device})
        with_fp8, without = plan(settings, shape), plan(settings, plain)
        casts = [item for item in with_fp8.items if item.part == "fp8 casts"]
        assert len(casts) == 1 and casts[0].bytes == 3 * 512 * 1024 + 2 * 256 * 1024 + extra
        assert not [item for item in without.items if item.part == "fp8 casts"]
        grown = with_fp8.tensors_peak() - without.tensors_peak()
        assert 0 < grown <= casts[0].bytes


def _convert(text: str, system: str) -> tuple[dict, dict[str, tuple[str, str]]]:
    import yaml

    from posttrain.convert.base import convert
    from posttrain.convert.run import SYSTEMS

    conv = convert(SYSTEMS[system], yaml.safe_load(text))
    return conv.config, {key: (verdict, detail) for key, verdict, detail in conv.lines}


def test_erniekit_fp8_maps_to_tensorwise_and_says_what_has_no_counterpart() -> None:
    config, lines = _convert(
        "model_name_or_path: m\nweight_quantize_algo: fp8_linear\napply_hadamard: true\n"
        "apply_online_actscale_step: 200\nuse_lowprecision_moment: true\n",
        "erniekit",
    )
    assert config["model"]["fp8"] == "tensorwise"
    assert lines["weight_quantize_algo"][0] == "approximated"
    assert lines["apply_hadamard"] == (
        "not supported",
        "True: no counterpart: torchao's float8 recipes cast without a Hadamard rotation (set it to false "
        "to accept that)",
    )
    assert lines["apply_online_actscale_step"][0] == "not needed"
    assert lines["use_lowprecision_moment"][0] == "not supported"
    off, lines = _convert("model_name_or_path: m\napply_hadamard: true\n", "erniekit")
    assert "fp8" not in off["model"] and "FP8 is off" in lines["apply_hadamard"][1]
    _, lines = _convert("model_name_or_path: m\nweight_quantize_algo: weight_only_int8\n", "erniekit")
    assert lines["weight_quantize_algo"][0] == "not supported"


@pytest.mark.parametrize(
    ("recipe", "fp8"),
    [
        ("bf16_with_fp8_current_scaling_mixed", "tensorwise"),
        ("bf16-with-fp8-delayed-scaling-mixed", "tensorwise"),
        ("fp8_cs", "tensorwise"),
        ("bf16_with_mxfp8_mixed", None),
        ("fp8_mx", None),
        ("bf16_with_fp8_subchannel_scaling_mixed", None),
        ("bf16_mixed", None),
    ],
)
def test_megatron_bridge_precision_recipes(recipe: str, fp8: str | None) -> None:
    config, lines = _convert(f"mixed_precision: {recipe}\n", "megatron-bridge")
    assert config.get("model", {}).get("fp8") == fp8
    verdict, detail = lines["mixed_precision"]
    if fp8 is None and "fp8" in recipe.replace("-", "_"):
        assert verdict == "not supported" and ("not offered" in detail or "no torchao" in detail)
    else:
        assert verdict == "mapped"
    if "delayed" in recipe:
        assert "becomes current scaling" in detail


def test_megatron_bridge_recipe_fields_are_read_together_in_any_order() -> None:
    text = (
        "mixed_precision:\n  num_layers_at_start_in_bf16: 2\n  fp8_wgrad: false\n  fp8_amax_history_len: 16\n"
        "  fp8: hybrid\n  fp8_recipe: tensorwise\n  fp8_dot_product_attention: true\n  fp4_recipe: nvfp4\n"
    )
    config, lines = _convert(text, "megatron-bridge")
    assert config["model"]["fp8"] == "rowwise_with_gw_hp"  # fp8_wgrad: false keeps weight gradients high
    assert config["model"]["fp8_filter_fqns"] == ["layers.0.", "layers.1."]
    assert lines["mixed_precision.fp8_dot_product_attention"][0] == "not supported"
    assert lines["mixed_precision.fp8_amax_history_len"][0] == "not needed"
    assert lines["mixed_precision.fp4_recipe"][0] == "not needed"
    _, off = _convert("mixed_precision: bf16_mixed\nmodel:\n  fp8_param_gather: true\n", "megatron-bridge")
    assert off["model.fp8_param_gather"] == ("not needed", "True: an FP8 setting, and FP8 is off")


def test_importing_torchao_through_posttrain_prints_nothing() -> None:
    code = "import posttrain; from transformers import LlamaForCausalLM; import torchao.float8; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok"
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr
