"""``posttrain convert`` on TRL's, Axolotl's and LLaMA-Factory's own published example configs
(``tests/resources/other_trainers``, byte for byte): each is detected, every key gets one line and none is
unknown, the converted config validates, and the settings a user of that trainer relies on land where they
mean the same thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from posttrain.config import load_config
from posttrain.config.base import other_trainers_hint
from posttrain.convert.base import UNKNOWN, Conversion
from posttrain.convert.run import SYSTEMS, convert_file, detect, main, read_source, render_config

PUBLISHED = Path(__file__).resolve().parents[1] / "resources" / "other_trainers"
FILES = sorted(p for p in PUBLISHED.glob("*/*") if p.suffix in (".yaml", ".yml"))


def converted(path: Path) -> Conversion:
    conv = convert_file(path, None)
    assert conv.system == path.parent.name
    return conv


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_published_examples_convert_with_a_line_per_key_and_validate(path: Path, tmp_path: Path) -> None:
    data = read_source(path)
    assert detect(data) == path.parent.name
    conv = converted(path)
    system = SYSTEMS[conv.system]
    flat = system.flatten(data)
    lined = {key for key, _, _ in conv.lines}
    assert set(flat) <= lined, set(flat) - lined  # every key has its line
    assert not [line for line in conv.lines if line[1] == UNKNOWN], conv.lines
    written = tmp_path / "run.yaml"
    written.write_text(render_config(conv, path))
    overrides = []
    if conv.config.get("type") == "grpo":  # TRL names Python reward functions; posttrain's are written out
        overrides.append('rewards=[{"type": "regex", "pattern": "a", "weight": 1.0}]')
    if conv.get("tokenizer.chat_template", "").endswith(".jinja"):
        overrides.append("tokenizer.chat_template=keep-original")
    config = load_config(written, overrides)  # pure: hub names and CUDA-only settings validate here
    assert config.type == conv.config["type"]


def test_axolotl_lora_example() -> None:
    conv = converted(PUBLISHED / "axolotl" / "lora-1b.yml")
    c = conv.config
    assert c["type"] == "sft"
    assert c["model"]["name_or_path"] == "NousResearch/Llama-3.2-1B"
    assert c["model"]["peft_config"] == {
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "target_modules": ["gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"],
    }
    assert "quantization_config" not in c["model"]
    assert c["model"]["dtype"] == "bfloat16" and c["model"]["attn_implementation"] == "sdpa"
    assert c["data"]["sources"] == [{"name_or_path": "teknium/GPT4-LLM-Cleaned"}]
    assert c["data"]["max_length"] == 2048 and c["data"]["pack_samples"] is True
    assert c["data"]["train_eval_split"] == [0.9, 0.1] and c["data"]["mask_inputs"] is True
    # two packed rows a micro-batch: one packed row, accumulated twice as often (the same tokens a step)
    assert c["micro_batch_size"] == 1 and c["gradient_accumulation_steps"] == 4 and c["epochs"] == 1
    assert c["optimizer"]["lr"] == 0.0002
    assert c["scheduler"] == {"name": "cosine", "warmup_steps": 10, "warmup_ratio": 0.0}
    assert c["eval_interval"] == 0.25  # evals_per_epoch: 4 over one epoch
    export, resumable = c["checkpoint"]
    assert export["output_dir"] == "./outputs/lora-out/export"
    assert (
        resumable["save_every_n_epochs"] == 1 and "save_every_n_steps" not in resumable
    )  # saves_per_epoch 1
    lines = {key: (verdict, detail) for key, verdict, detail in conv.lines}
    assert lines["optimizer"][0] == "mapped" and "8-bit" in lines["optimizer"][1]
    assert lines["loss_watchdog_threshold"][0] == "not supported"


def test_axolotl_qlora_dpo_and_kto_examples() -> None:
    qlora = converted(PUBLISHED / "axolotl" / "qlora-1b.yml").config
    assert qlora["model"]["quantization_config"] == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": "bfloat16",
    }
    dpo = converted(PUBLISHED / "axolotl" / "instruct-dpo-lora-8b.yml").config
    assert dpo["type"] == "dpo" and dpo["tokenizer"]["chat_template"] == "llama3"
    assert dpo["model"]["peft_config"]["target_modules"] == "all-linear"
    assert dpo["model"]["quantization_config"] == {"load_in_8bit": True}
    assert dpo["data"]["sources"] == [
        {"name_or_path": "fozziethebeat/alpaca_messages_2k_dpo_test", "columns": {"messages": "conversation"}}
    ]
    kto = converted(PUBLISHED / "axolotl" / "qlora-1b-kto.yaml").config
    assert kto["type"] == "kto" and kto["beta"] == 0.5 and kto["desirable_weight"] == 0.2
    assert "train_eval_split" not in kto["data"] and kto["eval_at_end"] is False


def test_llama_factory_examples_read_the_dataset_index_and_the_deepspeed_file() -> None:
    sft = converted(PUBLISHED / "llama-factory" / "llama3_lora_sft.yaml").config
    data_dir = PUBLISHED / "llama-factory" / "data"
    assert [Path(s["name_or_path"]).resolve() for s in sft["data"]["sources"]] == [
        data_dir / "identity.json",
        data_dir / "alpaca_en_demo.json",
    ]
    assert all(s["sample_count"] == 1000 for s in sft["data"]["sources"])
    assert sft["model"]["peft_config"] == {
        "r": 8,
        "target_modules": "all-linear",
        "lora_alpha": 16,  # LLaMA-Factory: 2 x rank
        "lora_dropout": 0.0,
    }
    assert sft["tokenizer"]["chat_template"] == "llama3" and sft["data"]["max_length"] == 2048
    assert sft["epochs"] == 3 and sft["scheduler"] == {"name": "cosine", "warmup_ratio": 0.1}
    full = converted(PUBLISHED / "llama-factory" / "llama3_full_sft.yaml").config
    assert "peft_config" not in full["model"]
    assert full["deepspeed"]["zero_optimization"] == {"stage": 3}  # read from ds_z3_config.json
    dpo = converted(PUBLISHED / "llama-factory" / "llama3_lora_dpo.yaml").config
    assert dpo["type"] == "dpo" and dpo["beta"] == 0.1 and dpo["loss_type"] == "sigmoid"
    kto = converted(PUBLISHED / "llama-factory" / "llama3_lora_kto.yaml").config
    assert (
        kto["type"] == "kto" and kto["data"]["train_eval_split"] == [0.9, 0.1] and kto["eval_interval"] == 500
    )
    vlm = converted(PUBLISHED / "llama-factory" / "qwen2_5vl_lora_sft.yaml").config
    assert vlm["tokenizer"]["chat_template"] == "keep-original"  # qwen2_vl: the checkpoint's own template
    qlora = converted(PUBLISHED / "llama-factory" / "llama3_lora_sft_otfq.yaml").config
    assert qlora["model"]["quantization_config"]["load_in_4bit"] is True


def test_trl_examples_take_the_trainer_from_their_keys(tmp_path: Path) -> None:
    grpo = converted(PUBLISHED / "trl" / "open_r1_grpo_config_demo.yaml")
    c = grpo.config
    assert c["type"] == "grpo" and c["num_generations"] == 7 and c["max_completion_length"] == 1024
    assert c["use_vllm"] is True and c["vllm_gpu_memory_utilization"] == 0.7 and c["log_completions"] is True
    assert c["data"]["max_prompt_length"] == 512 and c["wandb"]["enable"] is True
    assert c["checkpoint"][1]["save_every_n_epochs"] == 1 and c["checkpoint"][1]["save_total_limit"] == 1
    assert ("(rewards)", "not supported") in {(k, v) for k, v, _ in grpo.lines}
    dpo = converted(PUBLISHED / "trl" / "handbook_zephyr_dpo_config_full.yaml").config
    assert dpo["type"] == "dpo" and dpo["beta"] == 0.01 and dpo["data"]["max_prompt_length"] == 512
    assert [s["split"] for s in dpo["data"]["sources"]] == ["train_prefs", "test_prefs"]
    assert dpo["model"]["dtype"] == "bfloat16"  # torch_dtype: null (the checkpoint's), then bf16: true
    full = converted(PUBLISHED / "axolotl" / "fft-8b.yaml").config
    assert full["optimizer"]["lr"] == 2e-5  # `2e-5`: a string to PyYAML, a float to Axolotl
    sft = convert_file(PUBLISHED / "trl" / "cli_example_config.yaml", None).config
    assert sft["type"] == "sft" and sft["data"]["sources"] == [{"name_or_path": "stanfordnlp/imdb"}]
    # the same keys as JSON (TRL's parser reads both)
    as_json = tmp_path / "dpo.json"
    as_json.write_text(json.dumps(read_source(PUBLISHED / "trl" / "handbook_zephyr_dpo_config_full.yaml")))
    assert convert_file(as_json, None).config == dpo
    # an inline chat template becomes the .jinja file posttrain reads, beside the converted config
    report = main(PUBLISHED / "trl" / "handbook_zephyr_sft_config_qlora.yaml", None, tmp_path / "run.yaml")
    template = tmp_path / "run.jinja"
    assert "written to" in report and template.read_text().startswith("{% for message in messages %}")
    assert yaml.safe_load((tmp_path / "run.yaml").read_text())["tokenizer"]["chat_template"] == str(template)


@pytest.mark.parametrize(
    ("key", "posttrain"),
    [
        ("learning_rate", "optimizer.lr"),
        ("sequence_len", "data.max_length"),
        ("per_device_train_batch_size", "micro_batch_size"),
        ("num_train_epochs", "epochs"),
        ("gradient_accumulation_steps", None),  # posttrain's own key: no hint needed
        ("warmup_steps", "scheduler.warmup_steps"),
        ("sample_packing", "data.pack_samples"),
    ],
)
def test_other_trainers_names_point_to_posttrain_keys(key: str, posttrain: str | None) -> None:
    hint = other_trainers_hint(key)
    assert (posttrain in hint) if posttrain else hint == ""
