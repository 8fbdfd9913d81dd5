"""ERNIEKit (PaddleNLP-style) run configs: the flat files of ``examples/configs`` and the nested
``model_args``/``trainer_args`` form."""

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
    adam_beta,
    attention,
    blend_sources,
    export_engine,
    optimizer_offload,
    placeholder_data,
    precision_flag,
    remember,
    resumable_engine,
    step_limit,
    vision_freezes,
)
from posttrain.convert.fp8 import erniekit_fp8_on, erniekit_fp8_setting, erniekit_quantize

_STAGES = {"SFT": "sft", "DPO": "dpo", "PT": "causal"}
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "polynomial": "polynomial", "constant": "constant"}
_FORMATS = ("erniekit", "chatml")
#: the preference losses of ERNIEKit's DPO criterion (and its orpo switch)
ERNIEKIT_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "simpo",
    "dpop",
    "kto_pair",
    "sppo_hard",
    "nca_pair",
    "or",
    "orpo",
)
_PADDLE = "a PaddlePaddle performance or precision setting without a posttrain equivalent"


def _unwrap(data: dict[str, Any], conv: Conversion) -> dict[str, Any]:
    """The nested form groups the same keys under ``model_args``, ``trainer_args`` (and ``data_args``).
    Whether the file trains in FP8 is read first: its FP8 settings' lines depend on it."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("model_args", "trainer_args", "data_args", "finetuning_args") and isinstance(value, dict):
            out.update(value)
            conv.wrapped.update(dict.fromkeys(value, key))
        else:
            out[key] = value
    conv.scratch["fp8"] = erniekit_fp8_on(out)
    return out


def _listed(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v).strip() for v in value]
    return [part.strip() for part in str(value).split(",") if part.strip()]


def _dataset(part: str):
    def apply(conv: Conversion, key: str, value: Any) -> str:
        side, what = key.split("_dataset_")
        conv.scratch[(side, what)] = _listed(value)
        return f"data.{'sources' if side == 'train' else 'eval_sources'} ({part})"

    return apply


def _stage(conv: Conversion, key: str, value: Any) -> str:
    name = str(value).upper()
    if name not in _STAGES:
        raise Unsupported(f"one of {', '.join(_STAGES)}")
    conv.config["type"] = _STAGES[name]
    return f"type: {_STAGES[name]}"


def _fine_tuning(conv: Conversion, key: str, value: Any) -> str:
    if str(value).lower() == "lora":
        conv.scratch["lora"] = True
        return "model.peft_config (LoRA)"
    if str(value).lower() == "full":
        return "full fine-tuning (no peft_config)"
    raise Unsupported("Full or LoRA")


def _lora_flag(conv: Conversion, key: str, value: Any) -> str:
    if value:
        conv.scratch["lora"] = True
    return "model.peft_config (LoRA)" if value else "no LoRA"


def _lora(name: str):
    def apply(conv: Conversion, key: str, value: Any) -> str:
        conv.scratch[name] = value
        return f"model.peft_config.{ {'lora_rank': 'r', 'rslora': 'use_rslora'}.get(name, name) }"

    return apply


def _scheduler(conv: Conversion, key: str, value: Any) -> str:
    if value == "constant_with_warmup":
        conv.set("scheduler.lr_decay_style", "constant", key)
        return "scheduler.lr_decay_style: constant (with lr_warmup_iters)"
    if value not in _SCHEDULES:
        raise Unsupported(f"one of {', '.join(_SCHEDULES)}, constant_with_warmup")
    conv.set("scheduler.lr_decay_style", _SCHEDULES[value], key)
    return "scheduler.lr_decay_style"


#: ERNIE pretraining's ``decay_function`` -> the WSD anneal's shape
_WSD_DECAY = {"1-sqrt": "minus_sqrt", "linear": "linear", "cosine": "cosine", "exp": "exponential"}


def _lr_scheduler(conv: Conversion, key: str, value: Any) -> str:
    """ERNIE pretraining's ``lr_scheduler``: ``wsd:N`` (warmup, stable, then an anneal of N steps) or a
    schedule name."""
    name, _, steps = str(value).partition(":")
    if name == "wsd":
        if not steps.strip().isdigit():
            raise Unsupported("wsd:<anneal steps>")
        conv.set("scheduler.lr_decay_style", "WSD", key)
        conv.set("scheduler.lr_wsd_decay_iters", int(steps), key)
        conv.scratch.setdefault("wsd_style", "exponential")
        return f"scheduler.lr_decay_style: WSD, lr_wsd_decay_iters: {steps} (the number after wsd: is the anneal)"
    return _scheduler(conv, key, name)


def _decay_function(conv: Conversion, key: str, value: Any) -> str:
    if value not in _WSD_DECAY:
        raise Unsupported(f"one of {', '.join(_WSD_DECAY)}")
    conv.scratch["wsd_style"] = _WSD_DECAY[value]
    return f"scheduler.lr_wsd_decay_style: {_WSD_DECAY[value]} (with lr_scheduler: wsd:N)"


def _input_dir(conv: Conversion, key: str, value: Any) -> str:
    """``"0.4 prefix 0.6 prefix"`` (or one prefix): Megatron-style indexed datasets, weighted."""
    parts = str(value).split()
    if len(parts) == 1:
        conv.scratch["blend"] = [(parts[0], 1.0)]
    elif len(parts) % 2 == 0:
        try:
            conv.scratch["blend"] = [(parts[i + 1], float(parts[i])) for i in range(0, len(parts), 2)]
        except ValueError:
            raise Unsupported("'weight prefix weight prefix ...' or one prefix") from None
    else:
        raise Unsupported("'weight prefix weight prefix ...' or one prefix")
    return "data.sources (type: megatron, weighted)"


def _sharding(conv: Conversion, key: str, value: Any) -> str:
    stage = str(value).replace("stage", "").strip()
    if stage not in ("1", "2", "3"):
        raise Unsupported("stage1, stage2 or stage3")
    conv.set("deepspeed.zero_optimization.stage", int(stage), key)
    return "deepspeed.zero_optimization.stage (ZeRO shards like Paddle's sharding stages)"


def _compute_type(conv: Conversion, key: str, value: Any) -> str:
    kinds = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}
    if value not in kinds:
        raise Unsupported(f"{value}: weight-only quantised training is not supported (use bf16)")
    conv.set("model.dtype", kinds[value], key)
    if value == "fp8":  # bf16 weights, the products in FP8
        return f"model.dtype: bfloat16; {erniekit_quantize(conv, key, 'fp8_linear')}"
    return "model.dtype"


def _eval_strategy(conv: Conversion, key: str, value: Any) -> str:
    if value == "no":
        conv.scratch["no_eval"] = True
        return "no evaluation"
    if value == "steps":
        return "eval_interval (eval_steps)"
    if value == "epoch":
        conv.scratch["eval_epoch"] = True
        return "eval_at_end (posttrain evaluates every eval_interval steps and at the end)"
    raise Unsupported("steps, epoch or no")


def _flash(conv: Conversion, key: str, value: Any) -> str:
    return attention(conv, key, "flash_attention_2" if value else "sdpa")


def _loss_type(conv: Conversion, key: str, value: Any) -> str:
    """ERNIEKit's names are posttrain's; its ``orpo`` is ``or`` with the chosen NLL at weight 1 (ERNIEKit
    forces sft_loss_ratio to 1 and ignores beta)."""
    if value not in ERNIEKIT_LOSSES:
        raise Unsupported(f"ERNIEKit's loss types are {', '.join(ERNIEKIT_LOSSES)}")
    if value == "orpo":
        conv.scratch["orpo"] = True
        conv.set("loss_type", "or", key)
        return "loss_type: or, with sft_loss_ratio 1 (ERNIEKit's orpo: NLL + pref_loss_ratio x odds ratio)"
    conv.set("loss_type", value, key)
    return "loss_type"


def _packing(conv: Conversion, key: str, value: Any) -> str:
    conv.scratch["packing"] = bool(value)
    return "data.pack_samples (sft and causal; dpo does not pack)"


def _mix_strategy(conv: Conversion, key: str, value: Any) -> str:
    conv.scratch["mix"] = "concatenate" if value == "concat" else "weighted"
    return f"data.mix: {conv.scratch['mix']}"


def _do_train(conv: Conversion, key: str, value: Any) -> str:
    if not value:
        conv.set("skip_train", True, key)
        return "skip_train: true"
    return "training runs"


def _global_batch(conv: Conversion, total: int) -> None:
    """``global_batch_size`` decides: posttrain derives accumulation from it and the per-process batch (the
    micro-batch becomes the per-device cap), as ERNIE's pretraining divides it over its data-parallel ranks."""
    conv.set("total_train_batch_size", int(total), "global_batch_size")
    micro = conv.config.pop("micro_batch_size", None)
    if micro is not None:
        conv.set("max_per_device_train_batch_size", micro, "per_device_train_batch_size")
        conv.line(
            "(micro_batch_size)",
            APPROX,
            f"per_device_train_batch_size {micro} is max_per_device_train_batch_size under global_batch_size",
        )
    if conv.config.pop("gradient_accumulation_steps", None) is not None:
        conv.line(
            "(gradient_accumulation_steps)",
            APPROX,
            "derived from global_batch_size / (per-device batch x processes) at launch",
        )


def _finish(conv: Conversion) -> None:
    if "blend" in conv.scratch:  # pretraining data (input_dir): continued pretraining, whatever else is set
        conv.config.setdefault("type", "causal")
        blend_sources(conv, conv.scratch["blend"], conv.scratch.get("split"), "input_dir, split")
    conv.config.setdefault("type", "sft")
    if conv.scratch.get("orpo"):
        if conv.get("sft_loss_ratio", 1.0) != 1.0:
            conv.line("sft_loss_ratio", APPROX, "ERNIEKit's orpo sets it to 1 whatever the file says")
        conv.set("sft_loss_ratio", 1.0, "loss_type")
    if conv.get("scheduler.lr_decay_style") == "WSD":
        conv.set(
            "scheduler.lr_wsd_decay_style", conv.scratch.get("wsd_style", "exponential"), "decay_function"
        )
    if "global_batch_size" in conv.scratch:
        _global_batch(conv, conv.scratch["global_batch_size"])
    for side, target in (("train", "sources"), ("eval", "eval_sources")):
        paths = conv.scratch.get((side, "path"), [])
        probs = conv.scratch.get((side, "prob"), [])
        kinds = conv.scratch.get((side, "type"), [])
        if not paths:
            continue
        for kind in kinds:
            if kind not in _FORMATS:
                conv.line(
                    f"{side}_dataset_type", UNSUPPORTED, f"{kind!r}: posttrain reads erniekit and chatml rows"
                )
        sources = []
        for index, path in enumerate(paths):
            source: dict[str, Any] = {"name_or_path": path}
            if side == "train" and index < len(probs) and len(paths) > 1:
                source["sampling_weight"] = float(probs[index])
            sources.append(source)
        conv.set(f"data.{target}", sources, f"{side}_dataset_path/_prob/_type")
        if side == "train" and len(paths) > 1:
            conv.set("data.mix", conv.scratch.get("mix", "weighted"), "train_dataset_prob")
    if not conv.has("data.sources"):
        placeholder_data(conv, "no train_dataset_path or input_dir")
    if conv.scratch.get("packing") and conv.config["type"] != "dpo":
        conv.set("data.pack_samples", True, "packing")
        conv.set("micro_batch_size", 1, "packing (a packed sequence holds many samples)")
    if conv.scratch.get("lora"):
        rank = conv.scratch.get("lora_rank", 8)
        alpha = conv.scratch.get("lora_alpha", -1)
        peft: dict[str, Any] = {"r": rank, "lora_alpha": rank if alpha in (-1, None) else alpha}
        peft["target_modules"] = "all-linear"
        if conv.scratch.get("rslora"):
            peft["use_rslora"] = True
        conv.set("model.peft_config", peft, "fine_tuning: LoRA, lora_rank, lora_alpha, rslora")
    has_eval = conv.has("data.eval_sources")
    if not has_eval or conv.scratch.get("no_eval"):
        conv.config.pop("eval_interval", None)
        conv.set("eval_at_end", has_eval and not conv.scratch.get("no_eval"), "do_eval / eval data")
    if conv.scratch.get("eval_epoch"):
        conv.config.pop("eval_interval", None)
    out = conv.get("logger.output_dir", "runs/converted")
    engines = [export_engine(out)]
    if conv.scratch.get("save_steps") and conv.scratch.get("save_strategy", "steps") == "steps":
        engines.append(
            resumable_engine(out, conv.scratch["save_steps"], conv.scratch.get("save_total_limit"))
        )
    conv.set("checkpoint", engines, "output_dir, save_steps, save_strategy, save_total_limit")
    conv.config.setdefault("scheduler", {})["type"] = "megatron"


_ERNIE_FREEZES = {
    "freeze_vision": "model.freeze_vision_tower",
    "freeze_aligner": "model.freeze_multi_modal_projector",
    "freeze_llm": "model.freeze_language_model",
}


def _freeze_config(conv: Conversion, key: str, value: Any) -> str:
    """ERNIEKit's ``freeze_config`` (VL models): the parts it names, separated by spaces or ``|``."""
    names = [n for n in str(value or "").replace("|", " ").split() if n]
    unknown = [n for n in names if n not in _ERNIE_FREEZES]
    if unknown:
        raise Unsupported(f"{', '.join(unknown)}: posttrain freezes {', '.join(_ERNIE_FREEZES)} only")
    return vision_freezes(conv, {_ERNIE_FREEZES[n]: True for n in names}, key)


RULES = (
    Rule("stage", "type", SAME, apply=_stage),
    Rule(
        "freeze_config",
        "model.freeze_vision_tower / freeze_multi_modal_projector",
        SAME,
        apply=_freeze_config,
    ),
    Rule("fine_tuning", "model.peft_config", SAME, apply=_fine_tuning),
    Rule("lora", "model.peft_config", SAME, apply=_lora_flag),
    Rule("lora_rank", "model.peft_config.r", SAME, apply=_lora("lora_rank")),
    Rule(
        "lora_alpha",
        "model.peft_config.lora_alpha",
        SAME,
        "-1 means alpha = rank (scaling 1)",
        apply=_lora("lora_alpha"),
    ),
    Rule("rslora", "model.peft_config.use_rslora", SAME, apply=_lora("rslora")),
    Rule("lora_plus_scale", "optimizer.lora_plus_scale", SAME),
    Rule("rslora_plus", "", UNSUPPORTED, "rsLoRA+ is not built in", only_if=lambda v: not v),
    Rule("model_name_or_path", "model.name_or_path", SAME),
    Rule("train_dataset_path", "data.sources", SAME, apply=_dataset("paths")),
    Rule("train_dataset_prob", "data.sources[].sampling_weight", SAME, apply=_dataset("weights")),
    Rule(
        "train_dataset_type", "data.sources (row format, read from the rows)", SAME, apply=_dataset("formats")
    ),
    Rule("eval_dataset_path", "data.eval_sources", SAME, apply=_dataset("paths")),
    Rule("eval_dataset_prob", "", NOT_NEEDED, "every eval row is used", apply=_dataset("weights")),
    Rule("eval_dataset_type", "data.eval_sources (row format)", SAME, apply=_dataset("formats")),
    Rule(
        "mix_strategy",
        "data.mix",
        APPROX,
        "random and interleave_* become a weighted mix in which every row is used at least once; concat concatenates",
        apply=_mix_strategy,
    ),
    Rule("num_samples_each_epoch", "", NOT_NEEDED, "the weighted mix sizes itself from the data"),
    Rule("random_shuffle", "", NOT_NEEDED, "posttrain always shuffles (seeded)", only_if=lambda v: v is True),
    Rule("max_seq_len", "data.max_length", SAME),
    Rule("max_seq_length", "data.max_length", SAME),
    Rule(
        "base_seq_length",
        "",
        NOT_NEEDED,
        "ERNIE's sequence-length warm-up base; rows are data.max_length long",
    ),
    Rule("input_dir", "data.sources", SAME, apply=_input_dir),
    Rule("split", "data.sources[].split_ratio", SAME, apply=remember("split", "data.sources[].split_ratio")),
    Rule(
        "global_batch_size",
        "total_train_batch_size",
        SAME,
        apply=remember("global_batch_size", "total_train_batch_size"),
    ),
    Rule("max_grad_norm", "deepspeed.gradient_clipping", SAME),
    Rule("offload_optimizer", "optimizer.type: cpu_adam", SAME, apply=optimizer_offload),
    Rule("lr_scheduler", "scheduler.lr_decay_style", SAME, apply=_lr_scheduler),
    Rule("decay_function", "scheduler.lr_wsd_decay_style", SAME, apply=_decay_function),
    Rule("tokenizer_name", "tokenizer.name_or_path", SAME),
    Rule("max_prompt_len", "data.max_prompt_length", SAME),
    Rule("batch_size", "micro_batch_size", SAME),
    Rule("per_device_train_batch_size", "micro_batch_size", SAME),
    Rule("per_device_eval_batch_size", "", NOT_NEEDED, "evaluation uses micro_batch_size"),
    Rule("gradient_accumulation_steps", "gradient_accumulation_steps", SAME),
    Rule("max_steps", "train_iters", SAME, apply=step_limit("no step limit (num_train_epochs decides)")),
    Rule("num_train_epochs", "epochs", SAME, value=int),
    Rule("warmup_steps", "scheduler.lr_warmup_iters", SAME),
    Rule("learning_rate", "optimizer.lr", SAME),
    Rule("min_lr", "scheduler.min_lr", SAME),
    Rule("lr_scheduler_type", "scheduler.lr_decay_style", SAME, apply=_scheduler),
    Rule(
        "num_cycles",
        "",
        UNSUPPORTED,
        "cosine decays over half a wave to min_lr; other cycle counts are not built in",
        only_if=lambda v: v == 0.5,
    ),
    Rule("lr_end", "scheduler.min_lr", APPROX, "the polynomial schedule decays to min_lr"),
    Rule("power", "scheduler.power", SAME),
    Rule("layerwise_lr_decay_bound", "optimizer.layerwise_lr_decay_bound", SAME),
    Rule("weight_decay", "optimizer.weight_decay", SAME),
    Rule("adam_beta1", "optimizer.betas", SAME, apply=adam_beta(0)),
    Rule("adam_beta2", "optimizer.betas", SAME, apply=adam_beta(1)),
    Rule("adam_epsilon", "optimizer.eps", SAME),
    Rule("optim", "", NOT_NEEDED, "AdamW (decoupled weight decay) is posttrain's default optimizer"),
    Rule("offload_optim", "optimizer.type: cpu_adam", SAME, apply=optimizer_offload),
    Rule(
        "tensorwise_offload_optimizer",
        "optimizer.type: cpu_adam",
        APPROX,
        "ZeRO offloads the whole optimizer state to the host",
        apply=optimizer_offload,
    ),
    Rule("seed", "seed", SAME),
    Rule("sharding", "deepspeed.zero_optimization.stage", SAME, apply=_sharding),
    Rule("sharding_parallel_degree", "", NOT_NEEDED, "ZeRO shards over every data-parallel process"),
    Rule("sharding_parallel_config", "", NOT_NEEDED, _PADDLE),
    Rule(
        "tensor_parallel_degree",
        "",
        UNSUPPORTED,
        "tensor parallelism is not supported; posttrain shards with ZeRO (sharding) and splits long sequences with sequence_parallel_size",
        only_if=lambda v: int(v) <= 1,
    ),
    Rule(
        "pipeline_parallel_degree",
        "",
        UNSUPPORTED,
        "pipeline parallelism is not supported; use ZeRO stage 3",
        only_if=lambda v: int(v) <= 1,
    ),
    Rule(
        "virtual_pp_degree",
        "",
        UNSUPPORTED,
        "pipeline parallelism is not supported",
        only_if=lambda v: int(v) <= 1,
    ),
    Rule(
        "sequence_parallel",
        "",
        NOT_NEEDED,
        "Paddle's sequence parallelism belongs to tensor parallelism (degree 1 here); posttrain's Ulysses version is sequence_parallel_size",
    ),
    Rule("tensor_parallel_*", "", NOT_NEEDED, "tensor parallelism settings"),
    Rule("pipeline_parallel_config", "", NOT_NEEDED, "pipeline parallelism settings"),
    Rule("pp_seg_method", "", NOT_NEEDED, "pipeline parallelism settings"),
    Rule("add_tail_layers", "", NOT_NEEDED, "pipeline parallelism settings"),
    Rule("moe_*", "", NOT_NEEDED, "MoE communication settings of Paddle"),
    Rule("compute_type", "model.dtype", SAME, apply=_compute_type),
    Rule("bf16", "model.dtype", SAME, apply=precision_flag),
    Rule(
        "fp16",
        "model.dtype",
        SAME,
        apply=precision_flag,
    ),
    Rule("fp16_opt_level", "", NOT_NEEDED, "DeepSpeed's bf16/fp16 follows model.dtype"),
    Rule("amp_*", "", NOT_NEEDED, "DeepSpeed's bf16/fp16 follows model.dtype"),
    Rule("scale_loss", "", NOT_NEEDED, "DeepSpeed scales the fp16 loss dynamically"),
    Rule("recompute", "model.disable_activation_checkpoint", SAME, value=lambda v: not v),
    Rule("recompute_granularity", "", APPROX, "posttrain checkpoints whole decoder layers (full)"),
    Rule("recompute_use_reentrant", "", NOT_NEEDED, "posttrain checkpoints without re-entrance"),
    Rule("release_grads", "", NOT_NEEDED, "DeepSpeed frees gradients after each step"),
    Rule("use_flash_attention", "model.attn_implementation", SAME, apply=_flash),
    Rule(
        "use_sparse_flash_attn",
        "",
        NOT_NEEDED,
        "packed rows attend within their own sample through position ids",
    ),
    Rule(
        "use_attn_mask_startend_row_indices",
        "",
        NOT_NEEDED,
        "packed rows attend within their own sample through position ids",
    ),
    Rule(
        "use_sparse_head_and_loss_fn",
        "tiled_loss_compute",
        APPROX,
        "the LM head and loss run in chunks of labelled rows (auto from 8,192 tokens)",
    ),
    Rule(
        "use_fused_head_and_loss_fn",
        "tiled_loss_compute",
        APPROX,
        "the LM head and loss run in chunks of labelled rows (auto from 8,192 tokens)",
    ),
    Rule("fuse_rope", "", NOT_NEEDED, _PADDLE),
    Rule("fuse_linear", "", NOT_NEEDED, _PADDLE),
    Rule("fuse_*", "", NOT_NEEDED, _PADDLE),
    Rule("packing", "data.pack_samples", SAME, apply=_packing),
    Rule(
        "greedy_intokens",
        "data.packing",
        APPROX,
        "best-fit packing (posttrain's default) fills sequences greedily",
    ),
    Rule("dataloader_num_workers", "data.dl_num_workers", SAME),
    Rule(
        "distributed_dataloader",
        "",
        NOT_NEEDED,
        "each process reads its own shard of the memory-mapped sample store",
    ),
    Rule("do_train", "skip_train", SAME, apply=_do_train),
    Rule(
        "do_eval",
        "eval_at_end",
        SAME,
        apply=lambda c, k, v: (
            (c.scratch.update(no_eval=True) or "no evaluation") if not v else "evaluation on"
        ),
    ),
    Rule("eval_steps", "eval_interval", SAME),
    Rule("evaluation_strategy", "eval_interval", SAME, apply=_eval_strategy),
    Rule("max_evaluate_steps", "eval_iters", SAME, value=lambda v: max(int(v), 0)),
    Rule(
        "save_steps",
        "checkpoint[deepspeed].save_every_n_steps",
        SAME,
        apply=remember("save_steps", "checkpoint (deepspeed engine)"),
    ),
    Rule(
        "save_strategy",
        "checkpoint[deepspeed]",
        SAME,
        apply=remember("save_strategy", "checkpoint (deepspeed engine)"),
    ),
    Rule(
        "save_total_limit",
        "checkpoint[deepspeed].save_total_limit",
        SAME,
        apply=remember("save_total_limit", "checkpoint (deepspeed engine)"),
    ),
    Rule("output_dir", "logger.output_dir", SAME),
    Rule("logging_dir", "tensorboard.log_dir", SAME),
    Rule("logging_steps", "", NOT_NEEDED, "every optimizer step is logged to train-log-metrics.jsonl"),
    Rule("disable_tqdm", "logger.progress_bar", SAME, value=lambda v: not v),
    Rule(
        "unified_checkpoint*",
        "",
        NOT_NEEDED,
        "posttrain writes DeepSpeed checkpoints and safetensors exports",
    ),
    Rule("disable_ckpt_quant", "", NOT_NEEDED, "checkpoints are not quantised"),
    Rule(
        "ignore_save_lr_and_optim",
        "",
        UNSUPPORTED,
        "a resumable checkpoint always holds the optimizer state",
        only_if=lambda v: not v,
    ),
    Rule(
        "ignore_load_lr_and_optim",
        "",
        UNSUPPORTED,
        "resuming always restores the optimizer state",
        only_if=lambda v: not v,
    ),
    Rule("continue_training", "", NOT_NEEDED, "the weights of model_name_or_path are always loaded"),
    Rule("from_hf_hub", "", NOT_NEEDED, "model_name_or_path is a Hugging Face name or a local directory"),
    Rule(
        "from_aistudio", "", UNSUPPORTED, "posttrain loads Hugging Face checkpoints", only_if=lambda v: not v
    ),
    Rule(
        "from_modelscope",
        "",
        UNSUPPORTED,
        "posttrain loads Hugging Face checkpoints",
        only_if=lambda v: not v,
    ),
    Rule("beta", "beta", SAME),
    Rule("simpo_gamma", "simpo_gamma", SAME),
    Rule(
        "loss_type",
        "loss_type",
        SAME,
        apply=_loss_type,
        note="the same names; orpo becomes or with sft_loss_ratio 1 (ERNIEKit's own expansion)",
    ),
    Rule("dpop_lambda", "dpop_lambda", SAME),
    Rule("pref_loss_ratio", "pref_loss_ratio", SAME),
    Rule("sft_loss_ratio", "sft_loss_ratio", SAME),
    Rule("label_smoothing", "label_smoothing", SAME),
    Rule("reference_free", "reference_free", SAME),
    Rule("offset_alpha", "offset_alpha", SAME),
    Rule(
        "ref_model_update_steps",
        "",
        UNSUPPORTED,
        "the reference model is never updated",
        only_if=lambda v: int(v) < 0,
    ),
    Rule(
        "hidden_dropout_prob",
        "",
        UNSUPPORTED,
        "dropout comes from the model's config.json",
        only_if=lambda v: not v,
    ),
    Rule(
        "attention_probs_dropout_prob",
        "",
        UNSUPPORTED,
        "dropout comes from the model's config.json",
        only_if=lambda v: not v,
    ),
    Rule(
        "dropout_warmup_steps", "", UNSUPPORTED, "dropout schedules are not built in", only_if=lambda v: not v
    ),
    Rule(
        "weight_quantize_algo",
        "model.fp8",
        APPROX,
        "fp8_linear as torchao's tensorwise recipe; weight-only int4/int8 is not supported",
        apply=erniekit_quantize,
    ),
    Rule(
        "apply_hadamard",
        "",
        NOT_NEEDED,
        "an FP8 setting; true with FP8 on is not supported (torchao casts without a Hadamard rotation)",
        apply=erniekit_fp8_setting(
            "no counterpart: torchao's float8 recipes cast without a Hadamard rotation (set it to false to "
            "accept that)"
        ),
    ),
    Rule(
        "use_lowprecision_moment",
        "",
        UNSUPPORTED,
        "optimizer moments stay in float32",
        only_if=lambda v: not v,
    ),
    Rule(
        "apply_online_actscale_step",
        "",
        NOT_NEEDED,
        "an FP8 setting: torchao scales each activation by its own amax at every step",
        apply=erniekit_fp8_setting(
            "", when_on="torchao scales each activation by its own amax at every step (current scaling)"
        ),
    ),
    Rule("optim_shard_num", "", NOT_NEEDED, "DeepSpeed writes one optimizer shard per process"),
    Rule("use_sp_callback", "", NOT_NEEDED, _PADDLE),
    # the nested pretraining form's own keys
    Rule("env.*", "", NOT_NEEDED, "environment variables for ERNIE's launcher"),
    Rule("model_config.*", "", NOT_NEEDED, "architecture settings: posttrain reads config.json"),
    Rule("eval_iters", "eval_iters", SAME, value=lambda v: max(int(v), 0)),
    Rule("use_moe", "", NOT_NEEDED, "a mixture of experts is read from config.json"),
    Rule("gc_interval", "", NOT_NEEDED, "Python's collector runs as usual (manual_gc controls it)"),
    Rule("metrics_output_path", "", NOT_NEEDED, "metrics go to logger.output_dir"),
    Rule("log_global_grad_norm", "", NOT_NEEDED, "the gradient norm is logged every step"),
    Rule("global_logging_interval", "", NOT_NEEDED, "every optimizer step is logged"),
    Rule("enable_global_training_logs", "", NOT_NEEDED, "every optimizer step is logged"),
    Rule("overwrite_output_dir", "", NOT_NEEDED, "posttrain resumes from or writes beside what is there"),
    Rule("use_async_save", "", NOT_NEEDED, "checkpoints are written atomically"),
    Rule(
        "ignore_data_skip",
        "",
        UNSUPPORTED,
        "resuming always skips the data already seen",
        only_if=lambda v: not v,
    ),
    Rule("shuffle_consecutive", "", NOT_NEEDED, "posttrain shuffles samples (seeded)"),
    Rule("num_consecutive", "", NOT_NEEDED, _PADDLE),
    Rule("data_load_process_num", "data.num_proc", APPROX, "processes that tokenize the data"),
    Rule("prefetch_factor", "", NOT_NEEDED, _PADDLE),
    Rule("pipeline_schedule_mode", "", NOT_NEEDED, "pipeline parallelism settings"),
    Rule(
        "data_parallel_degree",
        "",
        NOT_NEEDED,
        "every process not in a sequence-parallel group is data-parallel",
    ),
    Rule("sharding_degree", "", NOT_NEEDED, "ZeRO shards over every data-parallel process"),
    Rule("sharding_comm_buffer_size_MB", "", NOT_NEEDED, _PADDLE),
    Rule("use_train_part_sharding", "", NOT_NEEDED, _PADDLE),
    Rule("load_sharded_model", "", NOT_NEEDED, "DeepSpeed checkpoints are sharded as ZeRO holds them"),
    Rule("save_sharded_model", "", NOT_NEEDED, "DeepSpeed checkpoints are sharded as ZeRO holds them"),
    Rule("skip_profile_timer", "", NOT_NEEDED, "step timings are in the metrics"),
    Rule("enable_optimizer_timer", "", NOT_NEEDED, "step timings are in the metrics"),
    Rule("enable_auto_parallel", "", NOT_NEEDED, _PADDLE),
    Rule("to_static", "", NOT_NEEDED, _PADDLE),
)

ERNIEKIT = System(
    name="erniekit",
    title="ERNIEKit",
    rules=RULES,
    defaults=(
        ("optimizer.weight_decay", 0.0, "ERNIEKit's default weight_decay is 0 (posttrain's 0.1)"),
        ("scheduler.lr_warmup_iters", 0, "ERNIEKit warms up only over warmup_steps"),
        ("scheduler.lr_decay_style", "linear", "ERNIEKit's default lr_scheduler_type"),
        ("model.disable_activation_checkpoint", True, "ERNIEKit recomputes only with recompute: true"),
        ("seed", 42, "ERNIEKit's default seed"),
    ),
    unwrap=_unwrap,
    finish=_finish,
)
