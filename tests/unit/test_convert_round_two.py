"""What real published files tripped on (issue #24), each with a small file of the same shape: Hugging Face
step ratios, wrapped files reported by their paths in the file, rules that only report, Megatron-Bridge
``ConfigContainer`` dumps and the perf scripts' layout, ArcticTraining's compatibility keys, and ERNIEKit's
nested pretraining form. Every converted file validates, and every reported key is a path in its file."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.config import load_config
from posttrain.config.errors import ConfigError
from posttrain.convert.base import APPROX, NOT_NEEDED, SAME, UNSUPPORTED, Conversion, convert
from posttrain.convert.run import SYSTEMS, detect
from posttrain.plan import interval_steps, resolve_intervals

SILOGEN_HELM: dict[str, Any] = {
    "finetuningGpus": 2,
    "basemodel": "hf://org/base-7b",
    "finetuning_config": {
        "method": "sft",
        "data_conf": {
            "training_data": {"type": "CONCATENATION", "datasets": [{"path": "train.jsonl"}]},
            "validation_data": {"type": "AUTO_SPLIT", "ratio": 0.1},
        },
        "training_args": {
            "learning_rate": 2e-5,
            "eval_steps": 0.2,
            "save_steps": 0.1,
            "logging_steps": 0.05,
            "save_strategy": "steps",
        },
        "run_conf": {"model": "/local_resources/basemodel", "model_args": {"dtype": "bfloat16"}},
        "batchsize_conf": {"total_train_batch_size": 8, "max_per_device_train_batch_size": 2},
    },
}

ERNIE_PRETRAIN: dict[str, Any] = {
    "env": {"HOME": None},
    "model_args": {
        "model_name_or_path": "./model",
        "tokenizer_name": "./model",
        "output_dir": "./output",
        "max_seq_length": 4096,
        "model_config": {"use_cache": False},
    },
    "trainer_args": {
        "input_dir": "0.4 ./data/part-a 0.6 ./data/part-b",
        "split": "998,1,1",
        "max_steps": 100,
        "learning_rate": 2.2e-4,
        "min_lr": 2.2e-5,
        "global_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4,
        "lr_scheduler": "wsd:60",
        "decay_function": "1-sqrt",
        "max_grad_norm": 0.5,
        "offload_optimizer": True,
        "recompute_granularity": "full",
        "bf16": True,
    },
}

BRIDGE_DUMP: dict[str, Any] = {
    "_target_": "megatron.bridge.training.config.ConfigContainer",
    "peft": None,
    "train": {
        "_target_": "megatron.bridge.training.config.TrainingConfig",
        "micro_batch_size": 1,
        "global_batch_size": 8,
        "train_iters": 50,
        "eval_interval": None,
        "skip_train": None,
        "manual_gc": True,
        "manual_gc_eval": 100,
    },
    "validation": {"_target_": "megatron.bridge.training.config.ValidationConfig", "eval_interval": 10, "eval_iters": 2},
    "dataset": {"_target_": "megatron.bridge.training.config.GPTDatasetConfig", "blend": [["./data/a"], None], "split": "98,1,1", "dataset_root": None},
    "checkpoint": {"_target_": "megatron.bridge.training.config.CheckpointConfig", "pretrained_checkpoint": "./model", "save": None},
    "optimizer": {"_target_": "megatron.core.optimizer.OptimizerConfig", "lr": 3e-4, "min_lr": None},
}  # fmt: skip


def lines(conv: Conversion) -> dict[str, tuple[str, str]]:
    return {key: (verdict, detail) for key, verdict, detail in conv.lines}


def in_file(data: dict[str, Any], key: str) -> bool:
    """Whether ``key`` is a dotted path of the file (a reported line's name)."""
    node: Any = data
    parts = key.split(".")
    while parts:
        if not isinstance(node, dict):
            return False
        for size in range(len(parts), 0, -1):  # keys may hold dots themselves
            head = ".".join(parts[:size])
            if head in node:
                node, parts = node[head], parts[size:]
                break
        else:
            return False
    return True


def check(system: str, data: dict[str, Any]) -> Conversion:
    """Convert, check every line names a path of the file and nothing None or '' is written, validate."""
    assert detect(data) == system
    conv = convert(SYSTEMS[system], data)
    for key, _, _ in conv.lines:
        assert key.startswith("(") or in_file(data, key), key

    def walk(node: Any, path: str) -> None:
        assert node is not None, f"{path} is null"
        if isinstance(node, dict):
            for name, value in node.items():
                assert name != "", f"a key named '' under {path}"
                walk(value, f"{path}.{name}")

    walk(conv.config, "")
    load_config(data=conv.config)  # validation is pure: the paths need not exist
    return conv


def test_hf_ratios_are_fractions_of_the_run() -> None:
    conv = check("silogen", SILOGEN_HELM)
    config = conv.config
    assert config["eval_interval"] == 0.2 and config["loss_log_interval"] == 0.05
    engine = next(c for c in config["checkpoint"] if c["type"] == "deepspeed")
    assert engine["save_every_n_steps"] == 0.1  # not silently 0
    resolved, notes = resolve_intervals(load_config(data=config), total_steps=150)
    assert (resolved.eval_interval, resolved.loss_log_interval) == (30, 8)
    assert resolved.checkpoint[1].save_every_n_steps == 15
    assert "eval_interval: 0.2 of the run's 150 steps = every 30 steps" in notes
    assert interval_steps(0.01, 10) == 1 and interval_steps(7, 10) == 7


def test_an_eval_ratio_without_eval_data_is_dropped_with_a_line() -> None:
    data = {**SILOGEN_HELM, "finetuning_config": {**SILOGEN_HELM["finetuning_config"]}}
    data["finetuning_config"]["data_conf"] = {
        "training_data": {"type": "CONCATENATION", "datasets": [{"path": "train.jsonl"}]},
        "validation_data": {"type": "NONE"},
    }
    conv = check("silogen", data)
    assert "eval_interval" not in conv.config
    verdict, detail = lines(conv)["(eval_interval)"]
    assert verdict == NOT_NEEDED and "no validation data" in detail


@pytest.mark.parametrize("value", [1.5, -0.2, "2.5"])
def test_a_fractional_interval_above_one_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="whole number of steps, or a fraction below 1"):
        load_config(
            data={"model": {"name_or_path": "m"}, "data": {"sources": ["d.jsonl"]}, "eval_interval": value}
        )


def test_wrapped_files_report_paths_in_the_file() -> None:
    helm = lines(check("silogen", SILOGEN_HELM))
    assert helm["finetuning_config.training_args.learning_rate"][0] == SAME
    assert "finetuningGpus" in helm and "training_args.learning_rate" not in helm
    assert helm["finetuning_config.run_conf.model_args.dtype"][0] == SAME  # transformers 5's spelling
    ernie = lines(check("erniekit", ERNIE_PRETRAIN))
    assert ernie["trainer_args.max_steps"][0] == SAME and "max_steps" not in ernie
    assert ernie["model_args.max_seq_length"][0] == SAME


def test_silogen_smaller_points() -> None:
    config = check("silogen", SILOGEN_HELM).config
    assert config["model"]["name_or_path"] == "org/base-7b"  # hf:// dropped
    assert config["model"]["dtype"] == "bfloat16"
    best = {**SILOGEN_HELM, "finetuning_config": {**SILOGEN_HELM["finetuning_config"]}}
    best["finetuning_config"]["training_args"] = {"save_strategy": "best", "save_steps": 10}
    verdict, detail = lines(check("silogen", best))["finetuning_config.training_args.save_strategy"]
    assert verdict == UNSUPPORTED and "no best checkpoint" in detail


def test_erniekit_nested_pretraining_keeps_its_settings() -> None:
    conv = check("erniekit", ERNIE_PRETRAIN)
    config = conv.config
    assert config["type"] == "causal"  # pretraining data, no stage key
    assert [s["name_or_path"] for s in config["data"]["sources"]] == ["./data/part-a", "./data/part-b"]
    assert [s["sampling_weight"] for s in config["data"]["sources"]] == [0.4, 0.6]
    assert config["data"]["eval_sources"][0]["split"] == "valid" and config["data"]["max_length"] == 4096
    assert config["deepspeed"]["gradient_clipping"] == 0.5
    assert config["total_train_batch_size"] == 16 and config["max_per_device_train_batch_size"] == 4
    assert "gradient_accumulation_steps" not in config and "micro_batch_size" not in config
    assert config["optimizer"]["type"] == "cpu_adam"
    assert config["scheduler"]["lr_decay_style"] == "WSD"
    assert config["scheduler"]["lr_wsd_decay_iters"] == 60
    assert config["scheduler"]["lr_wsd_decay_style"] == "minus_sqrt"
    assert config["tokenizer"]["name_or_path"] == "./model"
    verdict, _ = lines(conv)["trainer_args.recompute_granularity"]
    assert verdict == APPROX and "" not in config  # a rule without a target only reports


def test_megatron_bridge_dump_is_detected_and_nulls_are_not_copied() -> None:
    conv = check("megatron-bridge", BRIDGE_DUMP)
    config = conv.config
    assert config["manual_gc_eval"] is True  # an int where posttrain wants a bool
    assert config["eval_interval"] == 10 and config["eval_iters"] == 2  # the validation: section
    assert "skip_train" not in config
    assert lines(conv)["train.eval_interval"] == (NOT_NEEDED, "null: not set; posttrain's default applies")
    perf = {"ConfigContainer": BRIDGE_DUMP, "perf_matrix": {"gpus": [8, 16], "tp": [1, 2]}}
    wrapped = check("megatron-bridge", perf)
    found = lines(wrapped)
    assert found["perf_matrix"][0] == UNSUPPORTED
    assert "ConfigContainer.train.train_iters" in found


def test_arctictraining_compatibility_keys() -> None:
    base = {"model": {"name_or_path": "m"}, "data": {"sources": ["d.jsonl"]}}
    config = load_config(
        data={**base, "model": {"name_or_path": "m", "hf_config_kwargs": {"rope_theta": 1e6}}}
    )
    assert config.model.hf_config_kwargs == {"rope_theta": 1e6}
    assert (
        load_config(data={**base, "optimizer": {"type": "fused_adam_moe"}}).optimizer.type == "fused_adam_moe"
    )
    both = {**base, "data": {"sources": ["d.jsonl"], "use_data_cache": True, "cache_processed_data": True}}
    assert load_config(data=both).data.cache_enabled
    with pytest.raises(ConfigError, match="disagrees with use_data_cache"):
        load_config(
            data={
                **base,
                "data": {"sources": ["d.jsonl"], "use_data_cache": True, "cache_processed_data": False},
            }
        )


def test_helm_overlay_and_recipe_override_layouts() -> None:
    """The partial files people layer over a chart's values or a recipe: only what they change."""
    overlay = {
        "basemodel": "hf://org/base-1b",
        "finetuning_config": {
            "training_args": {"learning_rate": 1e-4, "num_train_epochs": 2, "eval_steps": 0.25}
        },
    }
    config = check("silogen", overlay).config
    assert config["optimizer"]["lr"] == 1e-4 and config["model"]["name_or_path"] == "org/base-1b"
    recipe = {
        "model": {"seq_length": 2048, "cross_entropy_loss_fusion": False},
        "train": {"train_iters": 600, "global_batch_size": 64, "micro_batch_size": 1, "eval_iters": 5},
        "optimizer": {"lr": 5e-6, "min_lr": 5e-6},
        "scheduler": {"lr_warmup_iters": 0},
        "dist": {"use_megatron_fsdp": False, "use_torch_fsdp2": False},
        "logger": {"log_interval": 1},
        "dataset": {"seq_length": 2048},
        "rng": {"seed": 42},
        "ddp": {"grad_reduce_in_fp32": True},
    }
    config = check("megatron-bridge", recipe).config
    assert config["train_iters"] == 600 and config["total_train_batch_size"] == 64
