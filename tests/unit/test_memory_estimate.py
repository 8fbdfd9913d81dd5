"""The memory plan's arithmetic: counts from config.json on the meta device, the itemised estimate against
hand-counted bytes and DeepSpeed's own estimator, the fixes, the size parser."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.config.model import ModelConfig
from posttrain.errors import UserError
from posttrain.memory.estimate import GiB, Settings, plan
from posttrain.memory.fixes import cheapest_fixes, fits
from posttrain.memory.machine import Machine, parse_size
from posttrain.memory.report import deepspeed_estimate, model_states, plan_text
from posttrain.memory.shape import model_shape

LLAMA = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1024, vocab_size=3000)  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("shape") / "llama"
    AutoConfig.for_model("llama", tie_word_embeddings=False, dtype="bfloat16", **LLAMA).save_pretrained(path)
    return path


def hand_count() -> int:
    h, i, v, layers = 256, 1024, 3000, 3
    kv = 2 * (h // 8)
    layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    return v * h * 2 + layers * layer + h  # embedding, head, layers, final norm


def test_shape_counts_from_config_json_alone(llama_dir: Path) -> None:
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))
    assert shape.params == shape.trainable == hand_count()
    assert (shape.embedding, shape.head, shape.layers, shape.kv_dim) == (3000 * 256, 3000 * 256, 3, 64)
    assert shape.dtype == "bfloat16" and shape.gated and shape.intermediate == 1024


def test_lora_shape_trains_only_the_adapters(llama_dir: Path) -> None:
    peft = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1}
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir), peft_config=peft))
    assert shape.trainable == 3 * (8 * (256 + 256) + 8 * (256 + 64))  # A: r x in, B: out x r
    assert shape.adapter_inputs == 2 * 256  # dropout copies each adapted module's input


def test_missing_config_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"model.name_or_path=.*nothing.*: is not a directory"):
        model_shape(ModelConfig(name_or_path=str(tmp_path / "nothing")))


def settings(**changes: object) -> Settings:
    base = Settings(dtype="bfloat16", world_size=8, stage=2, reduce_bucket=0, checkpointing=True)
    return replace(base, **changes)  # type: ignore[arg-type]


def test_zero2_model_states_match_deepspeeds_estimator(llama_dir: Path) -> None:
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))
    machine = Machine("cuda", 80 * GiB, 512 * GiB, 8)
    memory = plan(settings(), shape)
    _, device = deepspeed_estimate(memory, machine)  # type: ignore[misc]
    assert model_states(memory, "device") == pytest.approx(device, rel=1e-6)  # 2 P + 18 P / GPUs


def test_items_are_the_hand_counted_bytes(llama_dir: Path) -> None:
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))
    p = shape.params
    memory = plan(settings(dtype="float32", world_size=1, stage=0, device="cpu"), shape)
    by_part = {item.part: item.bytes for item in memory.items}
    assert by_part["parameters"] == by_part["gradients"] == 4 * p
    assert by_part["optimizer states"] == 8 * p and by_part["optimizer step temporaries"] == 4 * p
    assert "master weights" not in by_part and {i.place for i in memory.items} == {"host"}
    sharded = plan(settings(stage=3, world_size=4), shape)
    parts = {item.part: item for item in sharded.items}
    assert (
        parts["parameters"].bytes == pytest.approx(2 * p / 4) and parts["master weights"].bytes == 4 * p / 4
    )
    offloaded = plan(settings(stage=3, world_size=4, offload_optimizer="cpu", offload_param="cpu"), shape)
    assert {i.part for i in offloaded.items if i.place == "host" and i.phase == "states"} >= {
        "parameters",
        "master weights",
        "optimizer states",
    }


def test_activation_features_each_lower_the_peak(llama_dir: Path) -> None:
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))
    plain = settings(checkpointing=False, tiled_loss=False, tokens_per_row=32768, world_size=1, stage=0)
    peaks = [plan(plain, shape).device_peak]
    for change in (
        {"checkpointing": True},
        {"tiled_loss": True},
        {"tiled_mlp": True},
        {"sequence_parallel": 2},
    ):
        plain = replace(plain, **change)  # type: ignore[arg-type]
        peaks.append(plan(plain, shape).device_peak)
    assert all(later < earlier for earlier, later in itertools.pairwise(peaks)), peaks
    offloaded = plan(replace(plain, checkpoint_offload=True), shape)
    assert offloaded.device_peak < peaks[-1] and offloaded.host_peak > plan(plain, shape).host_peak


def test_fixes_come_in_order_until_the_plan_fits(llama_dir: Path) -> None:
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))
    memory = plan(
        settings(checkpointing=False, tiled_loss=False, tokens_per_row=65536, world_size=8, stage=0), shape
    )
    machine = Machine("cuda", 1.5 * GiB, 512 * GiB, 8, "small GPUs", described=True)
    assert fits(memory, machine) == (False, True)
    fixes, fixed = cheapest_fixes(memory, machine)
    assert fixed and fits(fixes[-1].plan, machine) == (True, True)
    changes = [fix.change for fix in fixes]
    assert changes[0] == "model.disable_activation_checkpoint: false"
    assert changes.index("tiled_loss_compute: true") < len(changes)
    assert all(fix.device_saved > 0 for fix in fixes)
    text = plan_text(memory, machine)
    assert "does NOT fit (the GPU)" in text and "1. model.disable_activation_checkpoint: false" in text


def test_host_overflow_suggests_disk(llama_dir: Path) -> None:
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))
    memory = plan(settings(world_size=1, offload_optimizer="cpu", optimizer="cpu_adam"), shape)
    machine = Machine("cuda", 80 * GiB, 0.05 * GiB, 1, "tiny host", described=True)
    assert fits(memory, machine) == (True, False)
    fixes, _ = cheapest_fixes(memory, machine)
    assert fixes[0].change.startswith("deepspeed.zero_optimization.offload_optimizer.device: nvme")
    assert fixes[0].host_saved > 0


@pytest.mark.parametrize(
    ("text", "size"),
    [("80GiB", 80 * 2**30), ("80GB", 80e9), ("512G", 512 * 2**30), ("1.5 TiB", 1.5 * 2**40), ("1024", 1024)],
)
def test_parse_size(text: str, size: float) -> None:
    assert parse_size(text, "--gpu-memory") == size


def test_parse_size_refuses_nonsense() -> None:
    with pytest.raises(UserError, match=r"--host-memory 'lots'.*e\.g\. 80GiB"):
        parse_size("lots", "--host-memory")


def test_moe_experts_split_over_expert_parallelism(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model(
        "mixtral", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=1000,
    ).save_pretrained(tmp_path)  # fmt: skip
    shape = model_shape(ModelConfig(name_or_path=str(tmp_path)))
    assert (shape.num_experts, shape.top_k, shape.expert_intermediate) == (8, 2, 256)
    assert shape.experts == 2 * 8 * 3 * 128 * 256  # layers x experts x (gate, up, down)
    one = plan(settings(world_size=2, stage=0, device="cpu"), shape)
    two = plan(settings(world_size=2, stage=0, expert_parallel=2, device="cpu"), shape)
    weights = {
        plan_.settings.expert_parallel: i.bytes
        for plan_ in (one, two)
        for i in plan_.items
        if i.part == "parameters"
    }
    assert weights[1] - weights[2] == pytest.approx(shape.experts / 2 * 2)  # half the experts, bf16


def test_online_rl_adds_the_generation_the_reference_and_vllms_share(llama_dir: Path) -> None:
    """grpo: the KV cache of a process's completions (keys and values, every layer, prompt + completion
    tokens), the last logits, a frozen reference model, vLLM's reserved share of the GPU."""
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))
    rl = settings(
        world_size=1,
        stage=1,
        generation_rows=32,
        generation_tokens=300,
        reference_model=True,
        vllm_share=0.3,
        gpu_memory=80 * GiB,
    )
    items = {item.part: item for item in plan(rl, shape).items}
    assert items["generation KV cache"].bytes == 2 * 3 * 64 * 32 * 300 * 2
    assert items["generation KV cache"].phase == "generation"
    assert items["generation logits"].bytes == 32 * 3000 * 4
    assert items["reference model"].bytes == hand_count() * 2 and items["reference model"].phase == "states"
    assert items["vLLM engine"].bytes == pytest.approx(0.3 * 80 * GiB)
    assert "generation KV cache" not in {i.part for i in plan(settings(), shape).items}


def test_sdpas_math_kernel_scores_on_cuda_in_float32_with_grouped_heads(llama_dir: Path) -> None:
    """transformers' grouped-head sdpa runs the math kernel in float32 on CUDA: each layer keeps its
    [heads, tokens, tokens] softmax and a layer's backward works on three more (measured on an H100,
    2026-11-26: the plan within 20% of max_memory_allocated at 2K and 8K tokens); not in bf16, not on a CPU,
    not for rows of documents (posttrain's per-document calls repeat the heads instead)."""
    shape = model_shape(ModelConfig(name_or_path=str(llama_dir)))  # 8 heads, 2 KV heads: grouped
    base = Settings(dtype="float32", world_size=1, stage=0, tokens_per_row=1024, checkpointing=False)
    scores = 8 * 1024 * 1024 * 4
    items = {i.part: i for i in plan(base, shape).items}
    assert (
        items["attention scores"].bytes == 3 * scores
        and items["attention scores"].phase == "forward+backward"
    )
    assert items["attention scores, backward"].bytes == 3 * scores
    recomputed = {i.part: i for i in plan(replace(base, checkpointing=True), shape).items}
    assert (
        recomputed["attention scores"].bytes == 4 * scores and "attention scores, backward" not in recomputed
    )
    for other in (
        replace(base, dtype="bfloat16"),
        replace(base, device="cpu"),
        replace(base, documents=True),
    ):
        assert not [i for i in plan(other, shape).items if i.part.startswith("attention scores")]
