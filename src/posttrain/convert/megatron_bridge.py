"""Megatron-Bridge ``ConfigContainer`` YAML: partial overrides and full dumps (with ``_target_`` entries)."""

from __future__ import annotations

from typing import Any

from posttrain.convert.base import (
    APPROX,
    NOT_NEEDED,
    SAME,
    UNSUPPORTED,
    Conversion,
    Rule,
    System,
    Unsupported,
    accept,
    adam_beta,
    blend_sources,
    export_engine,
    optimizer_offload,
    placeholder_data,
    precision_flag,
    remember,
    resumable_engine,
    to,
    vision_freezes,
    when_set,
)
from posttrain.convert.fp8 import (
    megatron_layer_rules,
    megatron_precision_recipe,
    megatron_rules,
    read_megatron,
)

_ARCHITECTURE = (
    "an architecture setting: posttrain reads it from the checkpoint's config.json (model.name_or_path)"
)
_NVIDIA = "an NVIDIA cluster setting (fault tolerance, straggler detection, rerun state machine) without a posttrain equivalent"


def _one(what: str, instead: str) -> Rule:
    return Rule(
        f"model.{what}",
        "",
        UNSUPPORTED,
        f"{what.replace('_', ' ')} other than 1 is not supported; {instead}",
        only_if=lambda v: v in (None, 1, False),
    )


def _blend(conv: Conversion, key: str, value: Any) -> str:
    """``blend``: ``[[prefix, ...], [weight, ...] or null]``; ``data_path``: ``[weight, prefix, ...]`` or prefixes."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
        prefixes, weights = value[0], value[1] or [1.0] * len(value[0])
    elif isinstance(value, list):
        if len(value) % 2 == 0 and all(_is_number(v) for v in value[::2]):
            weights, prefixes = [float(v) for v in value[::2]], value[1::2]
        else:
            prefixes, weights = value, [1.0] * len(value)
    else:
        prefixes, weights = [value], [1.0]
    conv.scratch["blend"] = list(zip(prefixes, weights, strict=True))
    return f"data.sources: {len(prefixes)} type: megatron sources with sampling_weight, data.mix: weighted"


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


_FREEZES = {
    "model.freeze_vision_model": "model.freeze_vision_tower",
    "model.freeze_vision_projection": "model.freeze_multi_modal_projector",
    "model.freeze_language_model": "model.freeze_language_model",
}


def _freeze(conv: Conversion, key: str, value: Any) -> str:
    """A VLM provider's ``freeze_*`` flags (all False by default there: every part trains): the three are
    written together, so posttrain's defaults (tower and projector frozen) never stand in for Megatron's."""
    frozen = conv.scratch.setdefault("frozen", {})
    frozen[_FREEZES[key]] = bool(value)
    vision_freezes(conv, frozen, key, own=(_FREEZES[key],))
    return f"{_FREEZES[key]}: {bool(value)} (parts no freeze_* key names train, as in Megatron-Bridge)"


def _dataset_root(conv: Conversion, key: str, value: Any) -> str:
    conv.scratch["dataset_root"] = str(value).rstrip("/")
    return "data.sources: <dataset_root>/training.jsonl, data.eval_sources: <dataset_root>/validation.jsonl"


def _peft_target(conv: Conversion, key: str, value: Any) -> str:
    names = {
        "linear_qkv": ["q_proj", "k_proj", "v_proj"],
        "linear_proj": ["o_proj"],
        "linear_fc1": ["gate_proj", "up_proj"],
        "linear_fc2": ["down_proj"],
    }
    modules: list[str] = []
    for name in value if isinstance(value, list) else [value]:
        modules += names.get(name, [name])
    conv.set("model.peft_config.target_modules", modules, key)
    return "model.peft_config.target_modules (Megatron's fused names as Hugging Face module names)"


def _peft(name: str):
    def apply(conv: Conversion, key: str, value: Any) -> str:
        conv.set(f"model.peft_config.{name}", value, key)
        return f"model.peft_config.{name}"

    return apply


def _mixed_precision(conv: Conversion, key: str, value: Any) -> str:
    """A recipe name (or the perf scripts' compute type): the weights' dtype, and FP8 when it names it."""
    text = str(value)
    fp8 = megatron_precision_recipe(conv, key, text)
    dtype = "float16" if text.startswith("fp16") else "float32" if text in ("fp32", "32") else "bfloat16"
    if "bf16" not in text and "fp16" not in text and not fp8:
        dtype = "float32"
    conv.set("model.dtype", dtype, key)
    return f"model.dtype: {dtype}" + (f"; {fp8}" if fp8 else "")


def _schedule_key(conv: Conversion, key: str, value: Any) -> str:
    from posttrain.config.scheduler import MegatronSchedulerConfig

    name = key.split(".", 1)[1]
    if name not in MegatronSchedulerConfig.model_fields:
        raise Unsupported("a scheduler key posttrain's megatron schedule does not have")
    conv.set(key, value, key)
    return key


def _unwrap(data: dict[str, Any], conv: Conversion) -> dict[str, Any]:
    """``checkpoint.save`` is known before any key is converted, so ``checkpoint.load`` is checked against it
    whatever the order of the two keys in the file."""
    if isinstance(data.get("ConfigContainer"), dict):  # the perf scripts: the container beside perf_matrix
        inner = data["ConfigContainer"]
        conv.wrapped.update(dict.fromkeys(inner, "ConfigContainer"))
        outer = {key: value for key, value in data.items() if key != "ConfigContainer"}
        data = {**outer, **inner}
    checkpoint = data.get("checkpoint")
    if isinstance(checkpoint, dict):
        conv.scratch["save"] = checkpoint.get("save")
    read_megatron(data, conv)
    return data


def _load(conv: Conversion, key: str, value: Any) -> str:
    if value not in (None, conv.scratch.get("save")):
        raise Unsupported("resuming from another directory than checkpoint.save; copy the checkpoint there")
    return "checkpoint[deepspeed].auto_resume"


def _finish(conv: Conversion) -> None:
    blend, root = conv.scratch.get("blend"), conv.scratch.get("dataset_root")
    if root:
        conv.config.setdefault("type", "sft")
        conv.set("data.sources", [f"{root}/training.jsonl"], "dataset.dataset_root")
        if conv.scratch.get("do_validation", True):
            conv.set("data.eval_sources", [f"{root}/validation.jsonl"], "dataset.dataset_root")
    elif blend:
        conv.config.setdefault("type", "causal")
        blend_sources(conv, blend, conv.scratch.get("split"), "dataset.blend / data_path / dataset.split")
    else:
        conv.config.setdefault("type", "causal")
        placeholder_data(conv, "no blend, data_path or dataset_root")
    if not conv.has("model.name_or_path"):
        conv.set(
            "model.name_or_path",
            conv.scratch.get("tokenizer") or "REPLACE-WITH-MODEL",
            "no pretrained_checkpoint",
        )
        conv.line(
            "(model)",
            APPROX,
            "no checkpoint.pretrained_checkpoint: model.name_or_path is the tokenizer's name or a placeholder to replace",
        )
    micro = conv.scratch.get("micro")
    if micro is not None:
        conv.set(
            "max_per_device_train_batch_size" if conv.has("total_train_batch_size") else "micro_batch_size",
            micro,
            "train.micro_batch_size",
        )
    has_eval = conv.has("data.eval_sources")
    if not has_eval:
        conv.config.pop("eval_interval", None)
        conv.config.pop("eval_iters", None)
        conv.set("eval_at_end", False, "no validation data")
    save = conv.scratch.get("save")
    if save:
        conv.set("logger.output_dir", save, "checkpoint.save")
        engine = resumable_engine(save, conv.scratch.get("save_interval"), conv.scratch.get("most_recent_k"))
        conv.set("checkpoint", [engine, export_engine(save)], "checkpoint.save, save_interval, most_recent_k")
    conv.config.setdefault("scheduler", {})["type"] = "megatron"
    if conv.has("model.peft_config"):
        conv.get("model.peft_config").setdefault("target_modules", "all-linear")
        peft = conv.get("model.peft_config")
        peft.setdefault("r", 32)
        peft.setdefault("lora_alpha", 32)


RULES = (
    Rule("*._target_", "", NOT_NEEDED, "a Hydra class path: posttrain's sections are fixed"),
    Rule("_target_", "", NOT_NEEDED, "a Hydra class path"),
    Rule("peft", "", NOT_NEEDED, "no adapters: full fine-tuning"),  # a dump's peft: null
    Rule(
        "perf_matrix",
        "",
        UNSUPPORTED,
        "the perf scripts' matrix of GPU counts and parallel sizes: convert one configuration at a time",
        whole=True,
    ),
    Rule("rng.seed", "seed", SAME),
    Rule("rng.*", "", NOT_NEEDED, "posttrain seeds Python, NumPy and PyTorch from seed on every rank"),
    Rule(
        "train.micro_batch_size",
        "micro_batch_size",
        SAME,
        apply=remember(
            "micro", "max_per_device_train_batch_size (with total_train_batch_size) or micro_batch_size"
        ),
    ),
    Rule("train.global_batch_size", "total_train_batch_size", SAME, apply=to("total_train_batch_size")),
    Rule("train.rampup_batch_size", "rampup_batch_size", SAME),
    Rule("train.train_iters", "train_iters", SAME),
    Rule("train.exit_interval", "exit_interval", SAME),
    Rule("train.exit_duration_in_mins", "exit_duration_in_mins", SAME),
    Rule(
        "train.exit_signal_handler",
        "",
        NOT_NEEDED,
        "SIGTERM and SIGINT always stop cleanly after the current step",
    ),
    Rule(
        "train.exit_signal", "", NOT_NEEDED, "SIGTERM and SIGINT always stop cleanly after the current step"
    ),
    Rule(
        "train.exit_signal_handler_for_dataloader",
        "",
        NOT_NEEDED,
        "signals stop the loop, not the data workers",
    ),
    Rule("train.manual_gc", "manual_gc", SAME),
    Rule("train.manual_gc_interval", "manual_gc_interval", SAME),
    Rule("train.manual_gc_eval", "manual_gc_eval", SAME, value=bool),  # dumps may hold an int
    Rule("train.eval_iters", "eval_iters", SAME),
    Rule("train.eval_interval", "eval_interval", SAME),
    Rule("validation.eval_interval", "eval_interval", SAME),  # the newer ValidationConfig section
    Rule("validation.eval_iters", "eval_iters", SAME),
    Rule("train.skip_train", "skip_train", SAME),
    Rule(
        "train.*",
        "",
        NOT_NEEDED,
        "a Megatron training-loop detail (memory levels, weight-hash checks, sync intervals)",
    ),
    Rule(
        "optimizer.optimizer",
        "optimizer.type",
        SAME,
        apply=accept(
            ("adam",),
            "posttrain's optimizers are Adam variants (adamw, cpu_adam, fused_adam)",
            "optimizer.type: adamw, the default (Megatron's adam has decoupled weight decay)",
        ),
    ),
    Rule("optimizer.lr", "optimizer.lr", SAME),
    Rule("optimizer.min_lr", "scheduler.min_lr", SAME),
    Rule("optimizer.weight_decay", "optimizer.weight_decay", SAME),
    Rule("optimizer.adam_beta1", "optimizer.betas", SAME, apply=adam_beta(0)),
    Rule("optimizer.adam_beta2", "optimizer.betas", SAME, apply=adam_beta(1)),
    Rule("optimizer.adam_eps", "optimizer.eps", SAME),
    Rule("optimizer.clip_grad", "deepspeed.gradient_clipping", SAME),
    Rule("optimizer.bf16", "model.dtype", SAME, apply=precision_flag),
    Rule("optimizer.fp16", "model.dtype", SAME, apply=precision_flag),
    Rule(
        "optimizer.use_distributed_optimizer",
        "deepspeed.zero_optimization.stage",
        APPROX,
        "Megatron's distributed optimizer shards optimizer state like ZeRO stage 1",
        apply=lambda c, k, v: (
            (c.set("deepspeed.zero_optimization.stage", 1, k) or "deepspeed.zero_optimization.stage: 1")
            if v
            else "not sharded"
        ),
    ),
    Rule(
        "optimizer.optimizer_cpu_offload",
        "optimizer.type: cpu_adam",
        SAME,
        apply=optimizer_offload,
    ),
    Rule(
        "optimizer.*",
        "",
        NOT_NEEDED,
        "a Megatron optimizer implementation detail (overlap, buckets, loss scale, params dtype)",
    ),
    Rule(
        "scheduler.override_opt_param_scheduler",
        "",
        NOT_NEEDED,
        "on resume the schedule always comes from the config",
    ),
    Rule(
        "scheduler.use_checkpoint_opt_param_scheduler",
        "",
        UNSUPPORTED,
        "on resume the schedule always comes from the config",
        only_if=lambda v: not v,
    ),
    Rule("scheduler.lr_warmup_steps", "", NOT_NEEDED, "derived by Megatron-Bridge from lr_warmup_iters"),
    Rule("scheduler.lr_decay_steps", "", NOT_NEEDED, "derived by Megatron-Bridge from lr_decay_iters"),
    Rule("scheduler.wd_incr_steps", "", NOT_NEEDED, "derived by Megatron-Bridge"),
    Rule("scheduler.wsd_decay_steps", "", NOT_NEEDED, "derived by Megatron-Bridge from lr_wsd_decay_iters"),
    Rule(
        "scheduler.lr_decay_samples",
        "",
        UNSUPPORTED,
        "schedules are counted in optimizer steps: use lr_decay_iters",
        only_if=lambda v: v is None,
    ),
    Rule("scheduler.*", "scheduler.* (type: megatron)", SAME, apply=_schedule_key),
    Rule("dataset.blend", "data.sources", SAME, apply=_blend),
    Rule("dataset.data_path", "data.sources", SAME, apply=_blend),
    Rule(
        "dataset.blend_per_split",
        "",
        UNSUPPORTED,
        "one blend split by document ranges (split) is supported; per-split blends are not",
        only_if=lambda v: v is None,
    ),
    Rule(
        "dataset.split",
        "data.sources[].split_ratio",
        SAME,
        apply=remember("split", "data.sources[].split_ratio (train) and data.eval_sources (valid)"),
    ),
    Rule("dataset.dataset_root", "data.sources", SAME, apply=_dataset_root),
    Rule(
        "dataset.do_validation",
        "data.eval_sources",
        SAME,
        apply=remember("do_validation", "data.eval_sources"),
    ),
    Rule("dataset.seq_length", "data.max_length", SAME),
    Rule("dataset.sequence_length", "data.max_length", SAME),
    Rule("dataset.seed", "data.seed", SAME),
    Rule("dataset.random_seed", "data.seed", SAME),
    Rule("dataset.num_workers", "data.dl_num_workers", SAME),
    Rule(
        "dataset.packed_sequence_specs",
        "data.pack_samples",
        APPROX,
        "posttrain packs with best-fit into data.max_length",
        apply=when_set("data.pack_samples", "no packing", True),
        whole=True,
    ),
    Rule(
        "dataset.*",
        "",
        NOT_NEEDED,
        "a Megatron data-loading detail (mmap, caches, sharding, builder threads); posttrain builds a memory-mapped sample store",
    ),
    Rule(
        "checkpoint.save",
        "checkpoint[deepspeed].output_dir",
        SAME,
        # read up front by _unwrap
        apply=lambda c, k, v: "checkpoint[deepspeed].output_dir (auto_resume: true) and logger.output_dir",
    ),
    Rule(
        "checkpoint.save_interval",
        "checkpoint[deepspeed].save_every_n_steps",
        SAME,
        apply=remember("save_interval", "checkpoint[deepspeed].save_every_n_steps"),
    ),
    Rule(
        "checkpoint.most_recent_k",
        "checkpoint[deepspeed].save_total_limit",
        SAME,
        apply=remember("most_recent_k", "checkpoint[deepspeed].save_total_limit"),
    ),
    Rule(
        "checkpoint.pretrained_checkpoint",
        "model.name_or_path",
        APPROX,
        "must be a Hugging Face checkpoint directory (export Megatron checkpoints with Megatron-Bridge's AutoBridge first)",
        apply=to("model.name_or_path"),
    ),
    Rule(
        "checkpoint.load",
        "",
        APPROX,
        "auto_resume continues from checkpoint.save (same directory) when it holds a checkpoint",
        apply=_load,
    ),
    Rule(
        "checkpoint.finetune",
        "",
        NOT_NEEDED,
        "a fine-tuning run loads only the weights of model.name_or_path",
    ),
    Rule(
        "checkpoint.*",
        "",
        NOT_NEEDED,
        "a Megatron checkpoint-format detail; posttrain writes DeepSpeed checkpoints and safetensors exports atomically",
    ),
    Rule("logger.log_interval", "", NOT_NEEDED, "every optimizer step is logged to train-log-metrics.jsonl"),
    Rule(
        "logger.tensorboard_dir",
        "tensorboard.log_dir",
        SAME,
        apply=lambda c, k, v: (
            (
                c.set("tensorboard.enable", True, k)
                or c.set("tensorboard.log_dir", v, k)
                or "tensorboard.enable + log_dir"
            )
            if v
            else "no TensorBoard"
        ),
    ),
    Rule("logger.log_throughput", "tensorboard.log_throughput", SAME),
    Rule("logger.log_params_norm", "tensorboard.log_params_norm", SAME),
    Rule("logger.log_memory_to_tensorboard", "tensorboard.log_memory", SAME),
    Rule("logger.log_timers_to_tensorboard", "tensorboard.log_timers", SAME),
    Rule(
        "logger.wandb_project",
        "wandb.project",
        SAME,
        apply=lambda c, k, v: (
            (c.set("wandb.enable", True, k) or c.set("wandb.project", v, k) or "wandb.enable + project")
            if v
            else "no W&B"
        ),
    ),
    Rule("logger.wandb_exp_name", "wandb.name", SAME),
    Rule("logger.wandb_entity", "wandb.entity", SAME),
    Rule(
        "logger.logging_level",
        "logger.level",
        SAME,
        value=lambda v: {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR"}.get(v, v),
    ),
    Rule("logger.*", "", NOT_NEEDED, "a Megatron logging detail"),
    Rule("profiling.use_pytorch_profiler", "profiling.use_pytorch_profiler", SAME),
    Rule("profiling.profile_step_start", "profiling.profile_step_start", SAME),
    Rule("profiling.profile_step_end", "profiling.profile_step_end", SAME),
    Rule("profiling.profile_ranks", "profiling.profile_ranks", SAME),
    Rule("profiling.record_shapes", "profiling.record_shapes", SAME),
    Rule(
        "profiling.record_memory_history",
        "mem_profiler",
        SAME,
        apply=when_set("mem_profiler", "off", "e2e"),
    ),
    Rule(
        "profiling.memory_snapshot_path",
        "mem_profiler_dir",
        APPROX,
        "the snapshot is written into this directory",
    ),
    Rule(
        "profiling.use_nsys_profiler",
        "",
        UNSUPPORTED,
        "run the launch under nsys yourself",
        only_if=lambda v: not v,
    ),
    Rule("peft.dim", "model.peft_config.r", SAME, apply=_peft("r")),
    Rule("peft.alpha", "model.peft_config.lora_alpha", SAME, apply=_peft("lora_alpha")),
    Rule("peft.dropout", "model.peft_config.lora_dropout", SAME, apply=_peft("lora_dropout")),
    Rule("peft.target_modules", "model.peft_config.target_modules", SAME, apply=_peft_target),
    Rule("peft.*", "", NOT_NEEDED, "a Megatron LoRA implementation detail (init methods, dropout position)"),
    Rule(
        "tokenizer.tokenizer_model",
        "tokenizer.name_or_path",
        SAME,
        apply=lambda c, k, v: (
            c.scratch.update(tokenizer=v) or c.set("tokenizer.name_or_path", v, k) or "tokenizer.name_or_path"
        ),
    ),
    Rule(
        "tokenizer.tokenizer_type",
        "tokenizer.type",
        SAME,
        apply=accept(
            ("HuggingFaceTokenizer", None),
            "posttrain loads Hugging Face tokenizers (HuggingFaceTokenizer)",
            "tokenizer.type: huggingface, the default",
        ),
    ),
    Rule(
        "tokenizer.*",
        "",
        NOT_NEEDED,
        "the Hugging Face tokenizer holds its own vocabulary and special tokens",
    ),
    Rule("mixed_precision", "model.dtype", SAME, apply=_mixed_precision),
    *megatron_rules("mixed_precision"),
    *megatron_layer_rules("mixed_precision"),
    Rule("mixed_precision.*", "", NOT_NEEDED, "DeepSpeed's bf16/fp16 follows model.dtype"),
    _one("tensor_model_parallel_size", "posttrain shards with ZeRO (deepspeed.zero_optimization.stage 3)"),
    _one("pipeline_model_parallel_size", "use ZeRO stage 3"),
    _one("virtual_pipeline_model_parallel_size", "use ZeRO stage 3"),
    _one("context_parallel_size", "long sequences split with sequence_parallel_size (Ulysses)"),
    Rule("model.expert_model_parallel_size", "expert_parallel_size", SAME),
    _one("expert_tensor_parallel_size", "experts are split whole over expert_parallel_size"),
    Rule("model.moe_aux_loss_coeff", "model.router_aux_loss_coef", SAME),
    Rule(
        "model.sequence_parallel",
        "",
        NOT_NEEDED,
        "Megatron's sequence parallelism belongs to tensor parallelism (size 1 here)",
    ),
    Rule("model.seq_length", "data.max_length", SAME),
    *(Rule(source, target, SAME, apply=_freeze) for source, target in _FREEZES.items()),
    *megatron_rules("model"),
    *megatron_layer_rules("model"),
    Rule("model.*", "", NOT_NEEDED, _ARCHITECTURE),
    Rule("ddp.*", "", NOT_NEEDED, "DeepSpeed does the data-parallel reduction"),
    Rule(
        "dist.*",
        "",
        NOT_NEEDED,
        "the launcher and DeepSpeed initialise the process group (nccl on GPU, gloo on CPU)",
    ),
    Rule(
        "comm_overlap.*",
        "",
        NOT_NEEDED,
        "tensor/pipeline communication overlap (no tensor or pipeline parallelism)",
    ),
    Rule("ft.*", "", NOT_NEEDED, _NVIDIA),
    Rule("straggler.*", "", NOT_NEEDED, _NVIDIA),
    Rule("nvrx_straggler.*", "", NOT_NEEDED, _NVIDIA),
    Rule("rerun_state_machine.*", "", NOT_NEEDED, _NVIDIA),
)

MEGATRON_BRIDGE = System(
    name="megatron-bridge",
    title="Megatron-Bridge",
    rules=RULES,
    defaults=(
        ("optimizer.weight_decay", 0.01, "megatron-core's default weight_decay"),
        ("scheduler.lr_decay_style", "linear", "Megatron-Bridge's default lr_decay_style"),
        ("seed", 1234, "Megatron-Bridge's default rng.seed"),
    ),
    unwrap=_unwrap,
    finish=_finish,
)
