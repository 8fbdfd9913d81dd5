"""Hugging Face ``TrainingArguments`` and TRL's trainer configs, the keys SiloGen, TRL, Axolotl and
LLaMA-Factory share: one table, written under a prefix (``training_args.`` in SiloGen's files, none in the
others), and the finishing step that turns the remembered save and eval settings into posttrain's
checkpoint engines and ``eval_interval``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from posttrain.config.dpo import LOSS_ALIASES, PREFERENCE_LOSSES
from posttrain.convert.base import (
    APPROX,
    NOT_NEEDED,
    SAME,
    UNSUPPORTED,
    Conversion,
    NotNeeded,
    Rule,
    Unsupported,
    accept,
    adam_beta,
    export_engine,
    precision_flag,
    remember,
    resumable_engine,
    step_limit,
    to,
)

DEEPSPEED = "checkpoint (deepspeed engine)"
#: transformers' ``optim`` names that are plain AdamW
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")
#: 8-bit and paged AdamW (bitsandbytes): posttrain's AdamW keeps full-precision moments
ADAMW_8BIT = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_torch_4bit")


def epochs(conv: Conversion, key: str, value: Any) -> str:
    if value is None:
        return "not overridden"
    if float(value) != int(value):
        conv.set("epochs", math.ceil(value), key)
        return (
            f"epochs: {math.ceil(value)} (fractional epochs are rounded up; set train_iters to stop earlier)"
        )
    conv.set("epochs", int(value), key)
    return "epochs"


def eval_strategy(conv: Conversion, key: str, value: Any) -> str:
    if value == "no":
        conv.scratch["no_eval"] = True
        return "no periodic evaluation (a held-out split is still evaluated once at the end)"
    if value == "steps":
        return "eval_interval (eval_steps)"
    if value == "epoch":
        conv.scratch["eval_epochs"] = True
        return "eval_interval: once an epoch (a share of the run's steps)"
    raise Unsupported("posttrain evaluates every eval_interval steps (and at the end); use eval_steps")


def report_to(conv: Conversion, key: str, value: Any) -> str:
    targets = [value] if isinstance(value, str) else list(value or [])
    done = []
    for target in targets:
        if target == "wandb":
            conv.set("wandb.enable", True, key)
            done.append("wandb.enable")
        elif target == "tensorboard":
            conv.set("tensorboard.enable", True, key)
            done.append("tensorboard.enable")
        elif target == "mlflow":
            done.append("tracking (see the tracking block)")
        elif target not in ("none", "all"):
            raise Unsupported(f"{target}: posttrain reports to wandb, mlflow (tracking) and tensorboard")
    return ", ".join(done) or "no trackers"


def save_strategy(conv: Conversion, key: str, value: Any) -> str:
    conv.scratch["save_strategy"] = value
    if value == "best":
        raise Unsupported(
            "posttrain keeps no best checkpoint; the export at the end is written, and save_steps saves "
            "resumable checkpoints only with save_strategy: steps"
        )
    if value == "epoch":
        conv.scratch["save_epochs"] = 1
        return f"{DEEPSPEED} save_every_n_epochs: 1"
    return DEEPSPEED


def preference_loss(conv: Conversion, key: str, value: Any) -> str:
    names = [value] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in PREFERENCE_LOSSES and n not in LOSS_ALIASES]
    if unknown:
        raise Unsupported(f"{', '.join(unknown)} not built in; posttrain has {', '.join(PREFERENCE_LOSSES)}")
    conv.set("loss_type", value, key)
    return "loss_type"


def optimizer_name(conv: Conversion, key: str, value: Any) -> str:
    """transformers' (and Axolotl's) ``optim`` names: AdamW variants become posttrain's AdamW."""
    if value in ADAMW:
        return "optimizer.type: adamw"
    if value in ADAMW_8BIT:
        return "optimizer.type: adamw (8-bit/paged AdamW: posttrain keeps full-precision moments; ZeRO shards them)"
    raise Unsupported("posttrain's optimizers are adamw, cpu_adam and fused_adam")


def resume_from(conv: Conversion, key: str, value: Any) -> str:
    if value in (None, False):
        return "no resume"
    if value in (True, "auto"):
        conv.scratch["resume"] = True
        return f"{DEEPSPEED} auto_resume: true"
    raise Unsupported(
        "resuming from a named path: posttrain resumes from its own checkpoint directory (auto_resume)"
    )


def deepspeed_file(conv: Conversion, key: str, value: Any) -> str:
    """A DeepSpeed JSON named by path: its ZeRO stage and offloads are read when the file is found (next to
    the config or under the working directory); ``auto`` values are posttrain's to fill."""
    if isinstance(value, dict):
        block = value
    else:
        path = near(conv, str(value))
        if path is None:
            raise Unsupported(
                f"{value} not found here: set deepspeed.zero_optimization.stage (and offload_*) by hand"
            )
        try:
            block = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise Unsupported(f"cannot read {path}: {exc}") from None
    zero = block.get("zero_optimization", {}) if isinstance(block, dict) else {}
    kept = {
        k: v for k, v in zero.items() if k in ("stage", "offload_optimizer", "offload_param") and v != "auto"
    }
    if not kept:
        raise NotNeeded("no ZeRO stage in it; posttrain's default (stage 2) applies")
    for name, setting in kept.items():
        conv.set(f"deepspeed.zero_optimization.{name}", setting, key)
    return ", ".join(f"deepspeed.zero_optimization.{name}" for name in kept)


def near(conv: Conversion, name: str) -> Path | None:
    """A file a config names, where it may be: as written (the working directory), then beside the config
    and up to three folders above it (a repository's examples/ run from its root); None when none is."""
    found = [Path(name)]
    source = conv.scratch.get("source_path")
    if source is not None and not Path(name).is_absolute():
        folder = Path(source).resolve().parent
        found += [parent / name for parent in [folder, *list(folder.parents)[:3]]]
    return next((path for path in found if path.is_file()), None)


def held_out_share(conv: Conversion, key: str, value: Any) -> str:
    """A held-out share of the rows (Axolotl's ``val_set_size``, LLaMA-Factory's ``val_size``) as
    ``data.train_eval_split``; a count of rows is refused (posttrain splits by share)."""
    if not value:
        return "no held-out split"
    if float(value) >= 1:
        raise Unsupported("a count of rows: posttrain holds out a share (data.train_eval_split)")
    conv.set("data.train_eval_split", [round(1 - float(value), 6), float(value)], key)
    conv.scratch["has_eval"] = True
    return "data.train_eval_split"


#: TrainingArguments' defaults that differ from posttrain's, written into a converted config
TRAINING_ARGUMENTS_DEFAULTS = (
    ("optimizer.weight_decay", 0.0, "TrainingArguments' default weight_decay"),
    ("scheduler.warmup_ratio", 0.0, "TrainingArguments has no warmup by default"),
)


def hub_upload(conv: Conversion, key: str, value: Any) -> str:
    if value:
        raise NotNeeded("posttrain never uploads; push the export folder with `huggingface-cli upload`")
    return "no upload"


def training_arguments(prefix: str = "") -> tuple[Rule, ...]:
    """``TrainingArguments`` keys (with TRL's DPOConfig keys that its trainers add) under ``prefix``."""
    p = prefix
    return (
        Rule(f"{p}learning_rate", "optimizer.lr", SAME),
        Rule(f"{p}weight_decay", "optimizer.weight_decay", SAME),
        Rule(f"{p}adam_beta1", "optimizer.betas", SAME, apply=adam_beta(0)),
        Rule(f"{p}adam_beta2", "optimizer.betas", SAME, apply=adam_beta(1)),
        Rule(f"{p}adam_epsilon", "optimizer.eps", SAME),
        Rule(f"{p}optim", "optimizer.type", SAME, apply=optimizer_name),
        Rule(f"{p}lr_scheduler_type", "scheduler.name", SAME),
        Rule(f"{p}lr_scheduler_kwargs", "scheduler.scheduler_kwargs", SAME, whole=True),
        Rule(f"{p}warmup_ratio", "scheduler.warmup_ratio", SAME),
        Rule(f"{p}warmup_steps", "scheduler.warmup_steps", SAME, apply=_warmup_steps),
        Rule(f"{p}num_train_epochs", "epochs", SAME, apply=epochs),
        Rule(f"{p}max_steps", "train_iters", SAME, apply=step_limit("no step limit (epochs decide)")),
        Rule(f"{p}per_device_train_batch_size", "micro_batch_size", SAME),
        Rule(f"{p}gradient_accumulation_steps", "gradient_accumulation_steps", SAME),
        Rule(f"{p}per_device_eval_batch_size", "", NOT_NEEDED, "evaluation uses micro_batch_size"),
        Rule(f"{p}max_grad_norm", "deepspeed.gradient_clipping", SAME),
        Rule(f"{p}seed", "seed", SAME),
        Rule(f"{p}data_seed", "data.seed", SAME),
        Rule(f"{p}bf16", "model.dtype", SAME, apply=precision_flag),
        Rule(f"{p}fp16", "model.dtype", SAME, apply=precision_flag),
        Rule(f"{p}tf32", "", NOT_NEEDED, "a GPU matmul setting; PyTorch's default applies"),
        Rule(
            f"{p}gradient_checkpointing", "model.disable_activation_checkpoint", SAME, value=lambda v: not v
        ),
        Rule(
            f"{p}gradient_checkpointing_kwargs",
            "",
            NOT_NEEDED,
            "posttrain checkpoints without re-entrance",
            whole=True,
        ),
        Rule(
            f"{p}logging_steps",
            "loss_log_interval",
            SAME,
            "the metrics file gets every step; below 1, a share of the run's steps",
        ),
        Rule(f"{p}logging_first_step", "", NOT_NEEDED, "every optimizer step is logged"),
        Rule(
            f"{p}logging_strategy",
            "loss_log_interval",
            SAME,
            apply=accept(
                ("steps",), "posttrain logs every loss_log_interval steps", "loss_log_interval (steps)"
            ),
        ),
        Rule(f"{p}logging_dir", "tensorboard.log_dir", SAME),
        Rule(
            f"{p}log_level", "", NOT_NEEDED, "posttrain's console says what it does; logger.level sets more"
        ),
        Rule(f"{p}eval_strategy", "eval_interval", SAME, apply=eval_strategy),
        Rule(f"{p}evaluation_strategy", "eval_interval", SAME, apply=eval_strategy),
        Rule(f"{p}eval_steps", "eval_interval", SAME, apply=remember("eval_steps", "eval_interval")),
        Rule(f"{p}do_train", "", NOT_NEEDED, "posttrain train trains"),
        Rule(f"{p}do_eval", "", NOT_NEEDED, "evaluation follows eval_interval and the eval data"),
        Rule(f"{p}save_strategy", "checkpoint", SAME, apply=save_strategy),
        Rule(
            f"{p}save_steps",
            "checkpoint[deepspeed].save_every_n_steps",
            SAME,
            apply=remember("save_steps", DEEPSPEED),
        ),
        Rule(
            f"{p}save_total_limit",
            "checkpoint[deepspeed].save_total_limit",
            SAME,
            apply=remember("save_total_limit", DEEPSPEED),
        ),
        Rule(f"{p}save_only_model", "", NOT_NEEDED, "the export holds the model; checkpoints hold the rest"),
        Rule(f"{p}resume_from_checkpoint", "checkpoint[deepspeed].auto_resume", SAME, apply=resume_from),
        Rule(
            f"{p}output_dir",
            "logger.output_dir",
            SAME,
            apply=to("logger.output_dir", "and the checkpoint directories under it"),
        ),
        Rule(f"{p}report_to", "wandb / tensorboard / tracking", SAME, apply=report_to),
        Rule(f"{p}run_name", "wandb.name", SAME),
        Rule(f"{p}dataloader_num_workers", "data.dl_num_workers", SAME),
        Rule(f"{p}remove_unused_columns", "", NOT_NEEDED, "posttrain keeps only what the formatter needs"),
        Rule(f"{p}ddp_*", "", NOT_NEEDED, "DeepSpeed does the data-parallel reduction"),
        Rule(f"{p}overwrite_output_dir", "", NOT_NEEDED, "checkpoints are written atomically"),
        Rule(f"{p}disable_tqdm", "logger.progress_bar", SAME, value=lambda v: not v),
        Rule(f"{p}deepspeed", "deepspeed.zero_optimization", SAME, apply=deepspeed_file, whole=True),
        Rule(f"{p}torch_compile", "model.compile", SAME),
        Rule(f"{p}push_to_hub", "", SAME, apply=hub_upload),
        Rule(f"{p}hub_*", "", NOT_NEEDED, "posttrain never uploads"),
        # TRL's DPOConfig (SiloGen's method: dpo runs TRL's DPOTrainer)
        Rule(f"{p}beta", "beta", SAME),
        Rule(f"{p}loss_type", "loss_type", SAME, apply=preference_loss),
        Rule(f"{p}loss_weights", "loss_weights", SAME),
        Rule(f"{p}label_smoothing", "label_smoothing", SAME),
        Rule(f"{p}discopop_tau", "discopop_tau", SAME),
        Rule(f"{p}reference_free", "reference_free", SAME),
        Rule(f"{p}rpo_alpha", "sft_loss_ratio", SAME, only_if=lambda v: v is None or v >= 0),
        Rule(f"{p}max_prompt_length", "data.max_prompt_length", SAME, value=lambda v: v or 0),
        Rule(
            f"{p}precompute_ref_log_probs",
            "",
            NOT_NEEDED,
            "posttrain always computes the reference log-probs once, before training",
        ),
        Rule(
            f"{p}f_divergence_type",
            "",
            UNSUPPORTED,
            "posttrain's losses use the reverse KL (DPO's own)",
            only_if=lambda v: v in ("reverse_kl", None),
        ),
        Rule(f"{p}use_weighting", "", UNSUPPORTED, "WPO weighting is not built in", only_if=lambda v: not v),
        Rule(f"{p}ld_alpha", "", UNSUPPORTED, "LD-DPO is not built in", only_if=lambda v: v is None),
        Rule(
            f"{p}sync_ref_model",
            "",
            UNSUPPORTED,
            "the reference model is never updated",
            only_if=lambda v: not v,
        ),
    )


def _warmup_steps(conv: Conversion, key: str, value: Any) -> str:
    if not value:
        return "no warmup steps (warmup_ratio decides)"
    conv.set("scheduler.warmup_steps", int(value), key)
    conv.scratch["warmup_steps"] = True  # the ratio, before or after it in the file, is dropped at the end
    return "scheduler.warmup_steps (it overrides warmup_ratio, as in TrainingArguments)"


def packed_batches(conv: Conversion) -> None:
    """A packed micro-batch of N rows of ``max_length`` (TRL, Axolotl, LLaMA-Factory) is N accumulation
    steps of one packed row here (posttrain packs a micro-batch into one row): the tokens per optimizer step
    stay the same."""
    rows = int(conv.get("micro_batch_size", 1))
    if not conv.get("data.pack_samples") or rows <= 1:
        return
    steps = int(conv.get("gradient_accumulation_steps", 1))
    conv.set("micro_batch_size", 1, "packing: one packed row a micro-batch")
    conv.set("gradient_accumulation_steps", steps * rows, "packing: the rows of a micro-batch accumulated")
    conv.line(
        "(micro_batch_size)",
        APPROX,
        f"{rows} packed rows a micro-batch -> micro_batch_size 1 x gradient_accumulation_steps {steps * rows} "
        "(the same tokens per optimizer step; posttrain packs a micro-batch into one row)",
    )


def finish_training_arguments(
    conv: Conversion, has_eval: bool, name: str = "export", merged: bool = False, epochs_default: int = 3
) -> None:
    """Write what the remembered keys combine into: the warmup (steps win over the ratio), ``eval_interval``
    (eval_steps, only with eval data and eval not off), and the checkpoint engines (the export at the end;
    a resumable checkpoint when the source saves every N steps or epochs, or resumes)."""
    packed_batches(conv)
    if conv.scratch.get("warmup_steps") and conv.has("scheduler.warmup_ratio"):
        conv.config["scheduler"].pop("warmup_ratio")
    eval_steps = conv.scratch.get("eval_steps")
    if conv.scratch.get("eval_epochs") and not eval_steps:  # once an epoch: a share of the run's steps
        run_epochs = int(conv.get("epochs", epochs_default))
        if run_epochs > 1:
            eval_steps = round(1 / run_epochs, 6)
        elif has_eval:  # one epoch: its end is the run's end
            conv.set("eval_interval", 0, "eval once an epoch: at the end of the one epoch")
    if eval_steps and has_eval and not conv.scratch.get("no_eval"):
        conv.set("eval_interval", eval_steps, "eval_steps")
    elif eval_steps:
        why = "no validation data" if not has_eval else "eval_strategy is no"
        conv.line("(eval_interval)", NOT_NEEDED, f"eval_steps={eval_steps!r} dropped: {why}")
    if not has_eval:
        conv.set("eval_at_end", False, "no validation data")
    out = conv.get("logger.output_dir", "runs/converted")
    engines = [export_engine(out, name, merged=merged)]
    strategy = conv.scratch.get("save_strategy", "steps")
    every = conv.scratch.get("save_steps") if strategy == "steps" else 0
    if conv.scratch.get("resume") or every or conv.scratch.get("save_epochs"):
        engine = resumable_engine(
            out, every, conv.scratch.get("save_total_limit"), bool(conv.scratch.get("resume"))
        )
        if conv.scratch.get("save_epochs"):
            engine["save_every_n_epochs"] = conv.scratch["save_epochs"]
        engines.append(engine)
    conv.set("checkpoint", engines, "save settings")


def peft_key(name: str) -> Any:
    """A LoRA setting written to ``model.peft_config.<name>``; kept only when the source turns an adapter on
    (:func:`finish_adapter`)."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if value is None:
            return "not set (PEFT's default)"
        conv.set(f"model.peft_config.{name}", value, key)
        return f"model.peft_config.{name}"

    return apply


def quant_key(name: str) -> Any:
    """A bitsandbytes setting written to ``model.quantization_config.<name>`` (QLoRA; needs a CUDA GPU)."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if value in (None, False):
            return "off"
        conv.set(f"model.quantization_config.{name}", value, key)
        return f"model.quantization_config.{name} (QLoRA: bitsandbytes on a CUDA GPU)"

    return apply


def lora_rules(prefix: str = "") -> tuple[Rule, ...]:
    """The adapter and quantisation keys TRL's ``ModelConfig`` and Axolotl share."""
    p = prefix
    return (
        Rule(f"{p}lora_r", "model.peft_config.r", SAME, apply=peft_key("r")),
        Rule(f"{p}lora_alpha", "model.peft_config.lora_alpha", SAME, apply=peft_key("lora_alpha")),
        Rule(f"{p}lora_dropout", "model.peft_config.lora_dropout", SAME, apply=peft_key("lora_dropout")),
        Rule(
            f"{p}lora_target_modules",
            "model.peft_config.target_modules",
            SAME,
            apply=peft_key("target_modules"),
        ),
        Rule(
            f"{p}lora_modules_to_save",
            "model.peft_config.modules_to_save",
            SAME,
            apply=peft_key("modules_to_save"),
        ),
        Rule(f"{p}use_rslora", "model.peft_config.use_rslora", SAME, apply=peft_key("use_rslora")),
        Rule(f"{p}use_dora", "model.peft_config.use_dora", SAME, apply=peft_key("use_dora")),
        Rule(
            f"{p}load_in_4bit",
            "model.quantization_config.load_in_4bit",
            SAME,
            apply=quant_key("load_in_4bit"),
        ),
        Rule(
            f"{p}load_in_8bit",
            "model.quantization_config.load_in_8bit",
            SAME,
            apply=quant_key("load_in_8bit"),
        ),
        Rule(
            f"{p}bnb_4bit_quant_type",
            "model.quantization_config.bnb_4bit_quant_type",
            SAME,
            apply=quant_key("bnb_4bit_quant_type"),
        ),
    )


def finish_adapter(
    conv: Conversion, enabled: bool, why_off: str, target_default: str = "all-linear", rank_default: int = 16
) -> None:
    """Keep the LoRA settings when the source trains an adapter (its target modules defaulting to
    ``target_default``), else drop them with a line; bitsandbytes settings without an adapter are dropped
    too (posttrain quantises only under an adapter). Rank and targets default to the source's."""
    if not enabled:
        for path in ("model.peft_config", "model.quantization_config"):
            if conv.has(path):
                conv.config["model"].pop(path.split(".")[1])
                conv.line(f"({path})", NOT_NEEDED, f"dropped: {why_off}")
        return
    if not conv.has("model.peft_config.target_modules"):
        conv.set("model.peft_config.target_modules", target_default, "the adapter's default targets")
    if not conv.has("model.peft_config.r"):
        conv.set("model.peft_config.r", rank_default, "the adapter's default rank")
    if conv.has("model.quantization_config.load_in_4bit"):
        conv.set("model.quantization_config.bnb_4bit_compute_dtype", "bfloat16", "QLoRA's compute dtype")


#: ``tokenizer.chat_template`` until ``posttrain convert -o`` has written an inline template to its file
INLINE_TEMPLATE = "chat_template.jinja"


def chat_template(keep_unknown: bool) -> Any:
    """A chat template named in the source: a posttrain preset (``llama3``, ``chatml``...) or a ``.jinja``
    file is kept; the tokenizer's own (``tokenizer_default``, ``default``) is ``keep-original``. Another
    name is the checkpoint's own template when ``keep_unknown`` (LLaMA-Factory's ``template`` names a
    formatting the checkpoint usually ships), else refused with the fix; an inline Jinja string is refused
    (posttrain reads templates from files)."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        from posttrain.tokenizers.chat_templates import CHOICES, KEEP_ORIGINAL

        name = str(value)
        if value in (None, "tokenizer_default", "default", "empty"):
            conv.set("tokenizer.chat_template", KEEP_ORIGINAL, key)
            return "tokenizer.chat_template: keep-original (the tokenizer's own)"
        if name in CHOICES or name.endswith(".jinja"):
            conv.set("tokenizer.chat_template", name, key)
            return "tokenizer.chat_template"
        if "{%" in name or "{{" in name:
            conv.scratch["inline_template"] = name
            conv.set("tokenizer.chat_template", INLINE_TEMPLATE, key)
            return (
                "tokenizer.chat_template: a .jinja file beside the converted config (posttrain reads files)"
            )
        if keep_unknown:
            conv.set("tokenizer.chat_template", KEEP_ORIGINAL, key)
            return f"tokenizer.chat_template: keep-original (the checkpoint's own template stands for {name})"
        raise Unsupported(
            f"not a posttrain preset ({', '.join(CHOICES)}); keep-original uses the checkpoint's own, or name a "
            ".jinja file"
        )

    return apply
