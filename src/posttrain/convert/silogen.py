"""SiloGen finetuning engine configs (also nested under ``finetuning_config:`` in a Helm values file)."""

from __future__ import annotations

from typing import Any

import yaml

from posttrain.convert.base import (
    NOT_NEEDED,
    SAME,
    UNSUPPORTED,
    Conversion,
    Rule,
    System,
    Unsupported,
    accept,
    attention,
    model_dtype,
    placeholder_data,
    process_count,
    remember,
    to,
)
from posttrain.convert.hf_args import (
    TRAINING_ARGUMENTS_DEFAULTS,
    epochs,
    finish_training_arguments,
    resume_from,
    training_arguments,
)

_DISTRIBUTED = {
    "auto-deepspeed-stage1": 1,
    "auto-deepspeed-stage3": 3,
    "auto-ddp": 0,
    "auto-single-process": 0,
}
_MIX = {"CONCATENATION": "concatenate", "PRECOMPUTE_WEIGHTED_MIX": "weighted"}


def _unwrap(data: dict[str, Any], conv: Conversion) -> dict[str, Any]:
    """A Helm values file holds the engine config under ``finetuning_config`` beside chart keys."""
    if not isinstance(data.get("finetuning_config"), dict):
        return data
    conv.scratch["helm"] = True
    # chart blocks (resources, image, storage...) are reported whole, one line each
    chart = {
        key: yaml.safe_dump(value, default_flow_style=True).strip() if isinstance(value, dict) else value
        for key, value in data.items()
        if key != "finetuning_config"
    }
    inner = data["finetuning_config"]
    conv.wrapped.update(dict.fromkeys(inner, "finetuning_config"))
    return {**chart, **inner}


def _datasets(conv: Conversion, key: str, value: Any) -> str:
    if not isinstance(value, list):
        raise Unsupported("expected a list of {path, sampling_weight}")
    side = "sources" if key.startswith("data_conf.training_data") else "eval_sources"
    sources = []
    for item in value:
        if not isinstance(item, dict) or "path" not in item:
            raise Unsupported("each dataset needs a path")
        source: dict[str, Any] = {"name_or_path": item["path"]}
        if "sampling_weight" in item and side == "sources":
            source["sampling_weight"] = item["sampling_weight"]
        sources.append(source)
    conv.set(f"data.{side}", sources, key)
    return f"data.{side} ({len(sources)} files)"


def _mix(conv: Conversion, key: str, value: Any) -> str:
    if key.startswith("data_conf.validation_data"):
        conv.scratch["validation"] = value
        if value == "NONE":
            return "no eval data"
        if value == "CONCATENATION":
            return "data.eval_sources"
        if value == "AUTO_SPLIT":
            conv.scratch.setdefault("split_ratio", 0.2)
            return "data.train_eval_split"
        raise Unsupported("validation_data.type is AUTO_SPLIT, CONCATENATION or NONE")
    if value not in _MIX:
        raise Unsupported(f"training_data.type is one of {', '.join(_MIX)}")
    conv.set("data.mix", _MIX[value], key)
    return "data.mix"


def _peft_type(conv: Conversion, key: str, value: Any) -> str:
    if value == "NO_PEFT":
        return "no adapter (full fine-tuning)"
    if value == "PRETRAINED_PEFT":
        return "model.peft_pretrained (from name_or_path)"
    conv.set("model.peft_config.peft_type", value, key)
    return "model.peft_config.peft_type"


def _quant_type(conv: Conversion, key: str, value: Any) -> str:
    if value == "no-quantization":
        return "no quantisation"
    conv.scratch["quantized"] = True
    return "model.quantization_config"


def _chat_template(conv: Conversion, key: str, value: Any) -> str:
    conv.set("tokenizer.chat_template", value, key)
    return "tokenizer.chat_template"


def _merge_adapter(conv: Conversion, key: str, value: Any) -> str:
    conv.scratch["merge"] = bool(value)
    return "checkpoint (huggingface export) save_merged"


def _basemodel(conv: Conversion, key: str, value: Any) -> str:
    """The chart's model: ``hf://org/name`` is the hub name ``org/name``."""
    name = str(value).removeprefix("hf://")
    conv.scratch["basemodel"] = name
    where = "model.name_or_path (when run_conf.model is the chart's default path)"
    return f"{where}, as {name!r}" if name != value else where


def _distributed(conv: Conversion, key: str, value: Any) -> str:
    if value not in _DISTRIBUTED:
        raise Unsupported(f"one of {', '.join(_DISTRIBUTED)}")
    conv.set("deepspeed.zero_optimization.stage", _DISTRIBUTED[value], key)
    return "deepspeed.zero_optimization.stage"


def _finish(conv: Conversion) -> None:
    method = conv.scratch.get("method", "sft")
    conv.config.setdefault("type", method)
    if method != "sft" and conv.has("data.mask_inputs"):
        conv.config["data"].pop("mask_inputs")
        conv.line("(data.mask_inputs)", NOT_NEEDED, "preference tuning trains the answers only")
    if not conv.has("data.sources"):  # an overlay of a chart's values: the data is in the chart's file
        placeholder_data(
            conv, "no data_conf.training_data (an overlay: the data is in the values it overlays)"
        )
    model = conv.get("model.name_or_path")
    if "basemodel" in conv.scratch and model in (None, "/local_resources/basemodel"):
        conv.set("model.name_or_path", conv.scratch["basemodel"], "basemodel")
    if not conv.has("model.name_or_path"):
        conv.set("model.name_or_path", "/local_resources/basemodel", "SiloGen's default run_conf.model")
    if conv.scratch.get("validation") == "AUTO_SPLIT":
        ratio = float(conv.scratch.get("split_ratio", 0.2))
        conv.set("data.train_eval_split", [round(1 - ratio, 6), ratio], "data_conf.validation_data.ratio")
        if "split_seed" in conv.scratch:
            conv.set("data.split_seed", conv.scratch["split_seed"], "data_conf.validation_data.seed")
    has_eval = conv.scratch.get("validation") in ("AUTO_SPLIT", "CONCATENATION")
    name = conv.scratch.get("final_checkpoint_name", "checkpoint-final")
    finish_training_arguments(conv, has_eval, name, merged=bool(conv.scratch.get("merge")))
    if has_eval and not conv.scratch.get("no_eval") and not conv.has("eval_interval"):
        conv.set("eval_interval", 0, "SiloGen evaluates at the end")
    if not conv.scratch.get("quantized") and conv.has("model.quantization_config"):
        conv.config["model"].pop("quantization_config")  # bits-and-bytes keys of a no-quantization dump
        conv.line(
            "(model.quantization_config)", NOT_NEEDED, "quant_conf.quantization_type is no-quantization"
        )


def _attention(conv: Conversion, key: str, value: Any) -> str:
    if value is None:
        return "transformers' choice (posttrain: sdpa)"
    return attention(conv, key, value)


def _quant_key(conv: Conversion, key: str, value: Any) -> str:
    name = key.rsplit(".", 1)[-1]
    conv.set(f"model.quantization_config.{name}", value, key)
    return f"model.quantization_config.{name}"


def _chart_key(conv: Conversion, key: str, value: Any) -> str:
    if not conv.scratch.get("helm"):
        raise Unsupported("not a SiloGen finetuning config key")
    return "not needed: a Helm chart key outside the finetuning config"


RULES = (
    Rule("method", "type", SAME, apply=lambda c, k, v: c.scratch.update(method=v) or "type"),
    Rule("data_conf.training_data.type", "data.mix", SAME, apply=_mix),
    Rule("data_conf.training_data.datasets", "data.sources", SAME, apply=_datasets),
    Rule("data_conf.training_data.seed", "data.mix_seed", SAME),
    Rule("data_conf.*.data_type", "", NOT_NEEDED, "set by the trainer type"),
    Rule("data_conf.validation_data.type", "data.eval_sources / data.train_eval_split", SAME, apply=_mix),
    Rule("data_conf.validation_data.datasets", "data.eval_sources", SAME, apply=_datasets),
    Rule(
        "data_conf.validation_data.ratio",
        "data.train_eval_split",
        SAME,
        apply=remember("split_ratio", "data.train_eval_split"),
    ),
    Rule(
        "data_conf.validation_data.seed",
        "data.split_seed",
        SAME,
        apply=remember("split_seed", "data.split_seed"),
    ),
    Rule("data_conf.chat_template_name", "tokenizer.chat_template", SAME, apply=_chat_template),
    Rule(
        "data_conf.padding_side",
        "",
        SAME,
        apply=accept(
            ("right",),
            "posttrain pads on the right (labels and positions depend on it)",
            "posttrain pads on the right",
        ),
    ),
    Rule("data_conf.missing_pad_token_strategy", "tokenizer.missing_pad_token_strategy", SAME),
    *training_arguments("training_args."),
    Rule("training_args.*", "", UNSUPPORTED, "a TrainingArguments key without a posttrain equivalent"),
    Rule("batchsize_conf.total_train_batch_size", "total_train_batch_size", SAME),
    Rule("batchsize_conf.max_per_device_train_batch_size", "max_per_device_train_batch_size", SAME),
    Rule(
        "batchsize_conf.per_device_eval_batch_size",
        "",
        NOT_NEEDED,
        "evaluation uses the training micro-batch",
    ),
    Rule("peft_conf.peft_type", "model.peft_config / model.peft_pretrained", SAME, apply=_peft_type),
    Rule("peft_conf.name_or_path", "model.peft_pretrained", SAME, apply=to("model.peft_pretrained")),
    Rule(
        "peft_conf.task_type",
        "",
        SAME,
        apply=accept(
            ("CAUSAL_LM",),
            "posttrain trains causal language models (CAUSAL_LM) only",
            "implied (posttrain adapters are CAUSAL_LM)",
        ),
    ),
    Rule(
        "peft_conf.peft_kwargs.*",
        "model.peft_config.*",
        SAME,
        apply=lambda c, k, v: (
            c.set(f"model.peft_config.{k.rsplit('.', 1)[-1]}", v, k)
            or f"model.peft_config.{k.rsplit('.', 1)[-1]}"
        ),
    ),
    Rule("quant_conf.quantization_type", "model.quantization_config", SAME, apply=_quant_type),
    Rule("quant_conf.*", "model.quantization_config.*", SAME, apply=_quant_key),
    Rule("run_conf.model", "model.name_or_path", SAME),
    Rule("run_conf.model_args.torch_dtype", "model.dtype", SAME, apply=model_dtype),
    Rule("run_conf.model_args.dtype", "model.dtype", SAME, apply=model_dtype),  # transformers 5's spelling
    Rule("run_conf.model_args.attn_implementation", "model.attn_implementation", SAME, apply=_attention),
    Rule("run_conf.model_args.trust_remote_code", "model.trust_remote_code", SAME),
    Rule("run_conf.model_args.revision", "model.revision", SAME),
    Rule(
        "run_conf.model_args.low_cpu_mem_usage",
        "",
        NOT_NEEDED,
        "transformers 5 always loads with low CPU memory",
    ),
    Rule(
        "run_conf.model_args.device_map",
        "",
        NOT_NEEDED,
        "DeepSpeed places the model on each process's device",
    ),
    Rule("run_conf.model_args.use_cache", "", NOT_NEEDED, "the KV cache is off in training"),
    Rule(
        "run_conf.model_args.token",
        "model.token_env",
        UNSUPPORTED,
        "a token in a config file leaks; export HF_TOKEN (model.token_env)",
        only_if=lambda v: v is None,
    ),
    Rule(
        "run_conf.model_args.*",
        "",
        UNSUPPORTED,
        "a from_pretrained argument posttrain does not pass",
        only_if=lambda v: v in (None, False, "main", {}),
    ),
    Rule("run_conf.tokenizer", "tokenizer.name_or_path", SAME),
    Rule(
        "run_conf.use_fast_tokenizer",
        "",
        UNSUPPORTED,
        "posttrain needs a fast tokenizer (offsets for the label mask)",
        only_if=lambda v: v is True,
    ),
    Rule("run_conf.resume_from_checkpoint", "checkpoint[deepspeed].auto_resume", SAME, apply=resume_from),
    Rule(
        "run_conf.final_checkpoint_name",
        "checkpoint[huggingface].output_dir",
        SAME,
        apply=remember("final_checkpoint_name", "checkpoint[huggingface].output_dir"),
    ),
    Rule("sft_args.max_seq_length", "data.max_length", SAME),
    Rule("sft_args.train_on_completions_only", "data.mask_inputs", SAME),
    Rule(
        "sft_args.save_name_if_new_basemodel",
        "",
        NOT_NEEDED,
        "the export directory is checkpoint[huggingface].output_dir",
    ),
    Rule("tracking.*", "tracking.*", SAME, apply=lambda c, k, v: c.set(k, v, k) or k),
    Rule("overrides.num_train_epochs", "epochs", SAME, apply=epochs),
    Rule("overrides.lr_multiplier", "optimizer.lr_multiplier", SAME),
    Rule("overrides.lr_batch_size_scaling", "optimizer.lr_batch_size_scaling", SAME),
    Rule("finetuningGpus", "--nproc", SAME, apply=process_count),
    Rule("distributedType", "deepspeed.zero_optimization.stage", SAME, apply=_distributed),
    Rule(
        "basemodel",
        "model.name_or_path",
        SAME,
        apply=_basemodel,
    ),
    Rule("mergeAdapter", "checkpoint[huggingface].save_merged", SAME, apply=_merge_adapter),
    Rule(
        "*",
        "",
        NOT_NEEDED,
        "a Helm chart key outside the finetuning config (resources, image, storage)",
        apply=_chart_key,
    ),
)

SILOGEN = System(
    name="silogen",
    title="SiloGen",
    rules=RULES,
    defaults=(
        (
            "data.mask_inputs",
            False,
            "SiloGen trains on every token unless sft_args.train_on_completions_only",
            ("sft",),
        ),
        ("tokenizer.chat_template", "mistral-with-system", "SiloGen's default chat_template_name"),
        ("optimizer.lr", 5e-5, "TrainingArguments' default learning_rate"),
        *TRAINING_ARGUMENTS_DEFAULTS,
        ("epochs", 3, "TrainingArguments' default num_train_epochs"),
        ("model.dtype", "auto", "SiloGen's default torch_dtype: auto"),
    ),
    unwrap=_unwrap,
    finish=_finish,
)
