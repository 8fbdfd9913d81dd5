"""``posttrain convert``: configs written in SiloGen's, ERNIEKit's and Megatron-Bridge's published shapes
(modelled on the seed documents), with the model and data pointing at local files, convert to posttrain
configs that validate and train the tiny model (one run per system and method)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.config import load_config
from posttrain.convert.base import UNKNOWN
from posttrain.convert.run import SYSTEMS, convert_file, render_config
from posttrain.run import run
from posttrain.testing.data import chat_rows, preference_rows, text_rows, write_jsonl
from tests.integration.test_megatron_data import counting_documents, write_megatron

pytestmark = pytest.mark.integration

#: what the test changes after conversion: the run's length and speed, never the converted settings
FAST = [
    "train_iters=2",
    "data.max_length=64",
    "data.dl_num_workers=0",
    "model.disable_activation_checkpoint=true",
]


def _erniekit_sft(row: dict) -> dict:
    messages = row["messages"]
    system = [m["content"] for m in messages if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    out: dict[str, Any] = {"src": users, "tgt": answers, "label": [1] * len(answers)}
    if len(answers) > 1:
        out["label"][0] = 0
    return out | ({"system": system[0]} if system else {})


def _erniekit_pair(row: dict) -> dict:
    return {
        "src": [row["prompt"]],
        "tgt": [],
        "response": [[row["rejected"]], [row["chosen"]]],
        "sort": [0, 1],
    }


def _silogen_pair(row: dict) -> dict:
    return {
        "prompt_messages": [{"role": "user", "content": row["prompt"]}],
        "chosen_messages": [{"role": "assistant", "content": row["chosen"]}],
        "rejected_messages": [{"role": "assistant", "content": row["rejected"]}],
    }


def silogen(model: Path, tmp: Path, method: str) -> dict:
    if method == "sft":
        a = write_jsonl(tmp / "a.jsonl", chat_rows(40, seed=1))
        b = write_jsonl(tmp / "b.jsonl", chat_rows(20, seed=2))
    else:
        a = write_jsonl(tmp / "a.jsonl", [_silogen_pair(r) for r in preference_rows(40, seed=1)])
        b = write_jsonl(tmp / "b.jsonl", [_silogen_pair(r) for r in preference_rows(20, seed=2)])
    return {
        "method": method,
        "data_conf": {
            "training_data": {
                "type": "PRECOMPUTE_WEIGHTED_MIX",
                "datasets": [
                    {"path": str(a), "sampling_weight": 2.0},
                    {"path": str(b), "sampling_weight": 1.0},
                ],
            },
            "validation_data": {"type": "AUTO_SPLIT", "ratio": 0.1, "seed": 7},
            "chat_template_name": "keep-original",
            "missing_pad_token_strategy": "bos-repurpose",
        },
        "training_args": {
            "learning_rate": 1e-3,
            "num_train_epochs": 1,
            "lr_scheduler_type": "cosine",
            "warmup_ratio": 0.1,
            "bf16": False,
            "gradient_checkpointing": False,
            "eval_strategy": "no",
            "save_strategy": "steps",
            "save_steps": 1,
            "output_dir": str(tmp / "out"),
            "seed": 3,
        },
        "batchsize_conf": {"total_train_batch_size": 4, "max_per_device_train_batch_size": 2},
        "peft_conf": {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "peft_kwargs": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
        },
        "quant_conf": {"quantization_type": "no-quantization"},
        "run_conf": {
            "model": str(model),
            "model_args": {"torch_dtype": "auto"},
            "resume_from_checkpoint": "auto",
        },
        "sft_args": {"max_seq_length": 64, "train_on_completions_only": True},
        "overrides": {"lr_multiplier": 1.0, "lr_batch_size_scaling": "none"},
    }


def erniekit(model: Path, tmp: Path, method: str) -> dict:
    if method == "SFT":
        rows = [[_erniekit_sft(r) for r in chat_rows(n, seed=s)] for n, s in ((40, 1), (20, 2))]
    elif method == "DPO":
        rows = [[_erniekit_pair(r) for r in preference_rows(n, seed=s)] for n, s in ((40, 1), (20, 2))]
    else:
        rows = [text_rows(n, seed=s) for n, s in ((40, 1), (20, 2))]
    a, b = write_jsonl(tmp / "a.jsonl", rows[0]), write_jsonl(tmp / "b.jsonl", rows[1])
    config: dict[str, Any] = {
        "train_dataset_type": "erniekit,erniekit",
        "train_dataset_path": f"{a},{b}",
        "train_dataset_prob": "0.7,0.3",
        "eval_dataset_type": "erniekit",
        "eval_dataset_path": str(b),
        "eval_dataset_prob": "1.0",
        "max_seq_len": 64,
        "model_name_or_path": str(model),
        "fine_tuning": "LoRA" if method != "PT" else "Full",
        "lora_rank": 4,
        "stage": method,
        "seed": 23,
        "do_train": True,
        "do_eval": True,
        "batch_size": 2,
        "gradient_accumulation_steps": 2,
        "num_train_epochs": 1,
        "max_steps": 4,
        "eval_steps": 2,
        "evaluation_strategy": "steps",
        "max_evaluate_steps": 2,
        "save_steps": 2,
        "save_strategy": "steps",
        "output_dir": str(tmp / "out"),
        "warmup_steps": 1,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "cosine",
        "min_lr": 1e-5,
        "adam_beta2": 0.95,
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        "sharding": "stage1",
        "recompute": False,
        "compute_type": "fp32",
        "unified_checkpoint": True,
        "disable_tqdm": True,
    }
    if method == "DPO":
        config |= {
            "beta": 0.1,
            "loss_type": "sigmoid",
            "pref_loss_ratio": 1.0,
            "sft_loss_ratio": 0.0,
            "max_prompt_len": 32,
        }
    return config


def megatron_bridge(model: Path, tmp: Path, method: str) -> dict:
    config: dict[str, Any] = {
        "_target_": "megatron.bridge.training.config.ConfigContainer",
        "rng": {"_target_": "megatron.bridge.training.config.RNGConfig", "seed": 1234},
        "train": {
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "train_iters": 4,
            "eval_interval": 2,
            "eval_iters": 2,
        },
        "optimizer": {
            "optimizer": "adam",
            "lr": 1e-3,
            "min_lr": 1e-5,
            "weight_decay": 0.1,
            "adam_beta2": 0.95,
            "clip_grad": 1.0,
            "bf16": False,
        },
        "scheduler": {"lr_decay_style": "cosine", "lr_warmup_iters": 1, "lr_decay_iters": 4},
        "checkpoint": {"save": str(tmp / "out"), "save_interval": 2, "pretrained_checkpoint": str(model)},
        "logger": {"log_interval": 1},
        "model": {
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "num_layers": 2,
            "hidden_size": 64,
        },
        "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(model)},
    }
    if method == "pretrain":
        write_megatron(tmp / "web", counting_documents(60, seed=2, vocab=1000))
        write_megatron(tmp / "code", counting_documents(30, seed=3, vocab=1000))
        config["dataset"] = {
            "_target_": "megatron.bridge.training.config.GPTDatasetConfig",
            "blend": [[str(tmp / "web"), str(tmp / "code")], [0.7, 0.3]],
            "split": "90,10,0",
            "seq_length": 64,
        }
    else:
        rows = [
            {"input": m["messages"][-2]["content"], "output": m["messages"][-1]["content"]}
            for m in chat_rows(40)
        ]
        write_jsonl(tmp / "squad" / "training.jsonl", rows)
        write_jsonl(tmp / "squad" / "validation.jsonl", rows[:8])
        config["dataset"] = {"dataset_root": str(tmp / "squad"), "seq_length": 64, "do_validation": True}
        config["peft"] = {
            "dim": 4,
            "alpha": 8,
            "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        }
    return config


PUBLISHED = Path(__file__).resolve().parents[1] / "resources" / "other_trainers"


def _published(name: str, model: Path, tmp: Path, **changes: Any) -> dict:
    """A published example config with the model (and whatever ``changes`` names) pointed at local files."""
    config = yaml.safe_load((PUBLISHED / name).read_text())
    key = "base_model" if name.startswith("axolotl/") else "model_name_or_path"
    return config | {key: str(model), "output_dir": str(tmp / "out")} | changes


def axolotl(model: Path, tmp: Path, method: str) -> dict:
    """Axolotl's own ``lora-1b.yml`` (alpaca rows, LoRA, packing, warmup steps, evals and saves per epoch)."""
    rows = [
        {"instruction": m["messages"][-2]["content"], "input": "", "output": m["messages"][-1]["content"]}
        for m in chat_rows(40)
    ]
    path = write_jsonl(tmp / "alpaca.jsonl", rows)
    return _published(
        "axolotl/lora-1b.yml",
        model,
        tmp,
        datasets=[{"path": str(path), "type": "alpaca"}],
        dataset_prepared_path=str(tmp / "prepared"),  # the file's is relative to the working directory
    )


def llama_factory(model: Path, tmp: Path, method: str) -> dict:
    """LLaMA-Factory's own ``llama3_lora_dpo.yaml``, its ``dpo_en_demo`` found through the published
    ``dataset_info.json`` in the dataset directory, with ranked ShareGPT rows."""
    data = tmp / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text((PUBLISHED / "llama-factory/data/dataset_info.json").read_text())
    rows = [
        {
            "conversations": [{"from": "human", "value": r["prompt"]}],
            "chosen": {"from": "gpt", "value": r["chosen"]},
            "rejected": {"from": "gpt", "value": r["rejected"]},
        }
        for r in preference_rows(40)
    ]
    (data / "dpo_en_demo.json").write_text(json.dumps(rows))
    return _published(
        "llama-factory/llama3_lora_dpo.yaml", model, tmp, dataset_dir=str(data), template="chatml"
    )


def trl(model: Path, tmp: Path, method: str) -> dict:
    """The alignment handbook's zephyr DPO recipe (a TRL DPOConfig), its mixture pointed at a local file."""
    path = write_jsonl(tmp / "pairs.jsonl", preference_rows(40))
    mixture = {"datasets": [{"id": str(path), "weight": 1.0}], "test_split_size": 0.1, "seed": 0}
    return _published("trl/handbook_zephyr_dpo_config_full.yaml", model, tmp, dataset_mixture=mixture)


CASES = [
    ("silogen", silogen, "sft", "sft"),
    ("silogen", silogen, "dpo", "dpo"),
    ("erniekit", erniekit, "SFT", "sft"),
    ("erniekit", erniekit, "DPO", "dpo"),
    ("erniekit", erniekit, "PT", "causal"),
    ("megatron-bridge", megatron_bridge, "pretrain", "causal"),
    ("megatron-bridge", megatron_bridge, "finetune", "sft"),
    ("axolotl", axolotl, "lora-1b", "sft"),
    ("llama-factory", llama_factory, "llama3_lora_dpo", "dpo"),
    ("trl", trl, "zephyr-dpo", "dpo"),
]


@pytest.mark.parametrize(
    ("system", "make", "method", "trainer"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES]
)
def test_converted_configs_validate_and_train(
    tiny_model_dir: Path, tmp_path: Path, system, make, method, trainer
) -> None:
    source = tmp_path / "source.yaml"
    source.write_text(yaml.safe_dump(make(tiny_model_dir, tmp_path, method)))
    conv = convert_file(source, None)  # the system is detected from the keys
    assert conv.system == system
    flat = SYSTEMS[system].flatten(SYSTEMS[system].unwrap(yaml.safe_load(source.read_text()), conv))
    lined = {key for key, _, _ in conv.lines}
    named = {conv.where(key) for key in flat}  # lines name keys by their path in the file
    assert named <= lined, named - lined  # every source key has its line
    assert not [line for line in conv.lines if line[1] == UNKNOWN], conv.lines
    written = tmp_path / "run.yaml"
    written.write_text(render_config(conv, source))
    config = load_config(written, FAST)
    assert config.type == trainer
    result = run(config)
    assert result.state.step == 2
    losses = [h["loss"] for h in result.state.history if "loss" in h]
    assert len(losses) == 2 and all(0 < loss < 100 for loss in losses)
