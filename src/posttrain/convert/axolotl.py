"""Axolotl configs (``axolotl train config.yml``): ``base_model``, ``datasets``, ``adapter``, ``rl``,
``micro_batch_size``, ``sequence_len``... flat, with the ``TrainingArguments`` names it passes through
(``learning_rate``, ``warmup_steps``, ``logging_steps``...) and TRL's under ``trl:`` for GRPO."""

from __future__ import annotations

from typing import Any

from posttrain.convert.base import (
    NOT_NEEDED,
    SAME,
    UNSUPPORTED,
    Conversion,
    NotNeeded,
    Rule,
    System,
    Unsupported,
    attention,
    placeholder_data,
    precision_flag,
    when_set,
)
from posttrain.convert.hf_args import (
    chat_template,
    epochs,
    finish_adapter,
    finish_training_arguments,
    held_out_share,
    lora_rules,
    optimizer_name,
    resume_from,
    training_arguments,
)
from posttrain.convert.trl import grpo_rules, rewards_to_write

#: Axolotl's ``rl`` values and posttrain's trainer (and DPO-family loss) for each
RL = {
    "dpo": ("dpo", None),
    "ipo": ("dpo", "ipo"),
    "orpo": ("dpo", "orpo"),
    "simpo": ("dpo", "simpo"),
    "kto": ("kto", None),
    "grpo": ("grpo", None),
}


def _rl(conv: Conversion, key: str, value: Any) -> str:
    if value in (None, False):
        return "no RL: type sft"
    if value not in RL:
        raise Unsupported(f"posttrain's methods for rl are {', '.join(RL)}")
    kind, loss = RL[value]
    conv.set("type", kind, key)
    if loss:
        conv.set("loss_type", loss, key)
        return f"type: {kind}, loss_type: {loss}"
    return f"type: {kind}"


def _datasets(conv: Conversion, key: str, value: Any) -> str:
    """``datasets:`` / ``test_datasets:`` entries: ``path`` (a hub name, a folder or a file, with
    ``data_files``), ``split``, and the row layout (``type``; ``field_messages`` and
    ``message_property_mappings`` rename the keys)."""
    if not isinstance(value, list):
        raise Unsupported("expected a list of {path, type}")
    side = "eval_sources" if key.startswith("test_datasets") else "sources"
    sources, notes = [], []
    for index, item in enumerate(value):
        if not isinstance(item, dict) or "path" not in item:
            raise Unsupported(f"entry {index} has no path")
        files = item.get("data_files")
        path = files if isinstance(files, str) else item["path"]
        source: dict[str, Any] = {"name_or_path": path}
        if item.get("split"):
            source["split"] = item["split"]
        columns = {}
        if item.get("field_messages") and item["field_messages"] != "messages":
            columns["messages"] = item["field_messages"]
        for ours, theirs in (item.get("message_property_mappings") or {}).items():
            if ours != theirs:
                columns[ours] = theirs
        for ours in ("chosen", "rejected", "prompt"):
            theirs = item.get(f"field_{ours}")
            if theirs and theirs != ours:
                columns[ours] = theirs
        if columns:
            source["columns"] = columns
        kind = str(item.get("type", ""))
        if kind and not (kind in ("alpaca", "sharegpt", "completion") or kind.startswith("chat_template")):
            notes.append(f"entry {index}'s type {kind} (a prompt strategy) is read from the rows' own keys")
        sources.append(source)
    conv.set(f"data.{side}", sources, key)
    if side == "eval_sources":
        conv.scratch["has_eval"] = True
    extra = f"; {'; '.join(notes)}" if notes else ""
    return f"data.{side} ({len(sources)}; alpaca, messages and preference rows load as they are){extra}"


def _adapter(conv: Conversion, key: str, value: Any) -> str:
    if not value:
        return "no adapter (full fine-tuning)"
    if value not in ("lora", "qlora"):
        raise Unsupported(
            "posttrain's converter carries lora and qlora (other PEFT types: model.peft_config)"
        )
    conv.scratch["adapter"] = value
    if value == "qlora":
        conv.set("model.quantization_config.load_in_4bit", True, key)
        conv.set("model.quantization_config.bnb_4bit_quant_type", "nf4", key)
        return "model.peft_config + model.quantization_config (4-bit NF4: bitsandbytes on a CUDA GPU)"
    return "model.peft_config"


def _bf16(conv: Conversion, key: str, value: Any) -> str:
    """``bf16: auto`` (where the device has it) as bfloat16; ``true``/``false`` as any ``bf16``/``fp16``
    switch."""
    if value == "auto":
        conv.set("model.dtype", "bfloat16", key)
        return (
            "model.dtype: bfloat16 (auto: where the device has it; posttrain falls back on a CPU without it)"
        )
    return precision_flag(conv, key, value)


def _flash(conv: Conversion, key: str, value: Any) -> str:
    if not value:
        return "not this kernel"
    return attention(conv, key, "flash_attention_2" if key == "flash_attention" else "sdpa")


def _per_epoch(what: str) -> Any:
    """``evals_per_epoch`` / ``saves_per_epoch``: N times an epoch, as a share of the run's steps when the
    run is one epoch (posttrain's intervals below 1 are shares of the run)."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if not value:
            return "not set"
        conv.scratch[f"{what}_per_epoch"] = int(value)
        return f"{'eval_interval' if what == 'evals' else 'checkpoint[deepspeed].save_every_n_steps'} (a share of the run)"

    return apply


def _special_tokens(conv: Conversion, key: str, value: Any) -> str:
    if key.endswith("pad_token"):
        raise NotNeeded(
            "the tokenizer's pad token is used, or tokenizer.missing_pad_token_strategy picks one; padding "
            "never reaches the loss"
        )
    raise Unsupported(
        "posttrain adds no tokens to the vocabulary; the chat template's tokens are the model's"
    )


def _wandb(conv: Conversion, key: str, value: Any) -> str:
    if value in (None, "", False):
        return "not set"
    name = key.removeprefix("wandb_")
    target = {
        "project": "wandb.project",
        "entity": "wandb.entity",
        "name": "wandb.name",
        "mode": "wandb.mode",
    }
    if name not in target:
        raise Unsupported("posttrain logs metrics to W&B, not gradients or model files")
    conv.set("wandb.enable", True, key)
    conv.set(target[name], value, key)
    return target[name]


def _finish(conv: Conversion) -> None:
    conv.config.setdefault("type", "sft")
    if not conv.has("data.sources"):
        placeholder_data(conv, "no datasets in the file")
    has_eval = bool(conv.scratch.get("has_eval"))
    run_epochs = conv.get("epochs", 1)
    for what, path in (("evals", "eval_steps"), ("saves", "save_steps")):
        per_epoch = conv.scratch.get(f"{what}_per_epoch")
        if not per_epoch or conv.scratch.get(path):
            continue
        if per_epoch == 1:  # at each epoch's end
            conv.scratch["eval_epochs" if what == "evals" else "save_epochs"] = 1
        else:  # N times an epoch: a share of the whole run's steps
            conv.scratch[path] = round(1 / (per_epoch * run_epochs), 6)
    finish_adapter(
        conv,
        conv.scratch.get("adapter") is not None,
        "no adapter: lora or qlora (full fine-tuning)",
        target_default="all-linear",
        rank_default=8,
    )
    finish_training_arguments(conv, has_eval, epochs_default=1)
    rewards_to_write(conv)
    if conv.get("type") == "sft" and not conv.has("data.mask_inputs"):
        conv.set("data.mask_inputs", True, "Axolotl's train_on_inputs: false")


RULES = (
    Rule("base_model", "model.name_or_path", SAME),
    Rule("base_model_config", "model.name_or_path", NOT_NEEDED, "the config is read from the model's folder"),
    Rule("model_type", "", NOT_NEEDED, "AutoModelForCausalLM reads the architecture from the checkpoint"),
    Rule("tokenizer_type", "", NOT_NEEDED, "AutoTokenizer reads the tokenizer from the checkpoint"),
    Rule("tokenizer_config", "tokenizer.name_or_path", SAME),
    Rule("trust_remote_code", "model.trust_remote_code", SAME),
    Rule("revision_of_model", "model.revision", SAME),
    Rule("strict", "", NOT_NEEDED, "posttrain refuses unknown keys always"),
    Rule("chat_template", "tokenizer.chat_template", SAME, apply=chat_template(keep_unknown=False)),
    Rule("chat_template_jinja", "tokenizer.chat_template", SAME, apply=chat_template(keep_unknown=False)),
    Rule("rl", "type", SAME, apply=_rl),
    Rule("rl_beta", "beta", SAME),
    Rule("dpo_beta", "beta", SAME),
    Rule("orpo_alpha", "beta", SAME),
    Rule("kto_desirable_weight", "desirable_weight", SAME),
    Rule("kto_undesirable_weight", "undesirable_weight", SAME),
    Rule("datasets", "data.sources", SAME, apply=_datasets, whole=True),
    Rule("test_datasets", "data.eval_sources", SAME, apply=_datasets, whole=True),
    Rule(
        "dataset_prepared_path",
        "data.cache_dir",
        SAME,
        apply=when_set("data.cache_dir", "posttrain's cache"),
    ),
    Rule("dataset_processes", "data.num_proc", SAME),
    Rule("shuffle_merged_datasets", "", NOT_NEEDED, "posttrain shuffles with data.seed"),
    Rule("val_set_size", "data.train_eval_split", SAME, apply=held_out_share),
    Rule("adapter", "model.peft_config", SAME, apply=_adapter),
    Rule(
        "lora_model_dir",
        "model.peft_pretrained",
        SAME,
        apply=when_set("model.peft_pretrained", "a new adapter"),
    ),
    Rule(
        "lora_target_linear",
        "model.peft_config.target_modules",
        SAME,
        apply=when_set("model.peft_config.target_modules", "not set", "all-linear"),
    ),
    Rule(
        "lora_fan_in_fan_out",
        "model.peft_config.fan_in_fan_out",
        SAME,
        apply=when_set("model.peft_config.fan_in_fan_out", "off"),
    ),
    *lora_rules(),
    Rule("sequence_len", "data.max_length", SAME),
    Rule("sample_packing", "data.pack_samples", SAME),
    Rule("eval_sample_packing", "", NOT_NEEDED, "evaluation batches as training does"),
    Rule("pad_to_sequence_len", "", NOT_NEEDED, "posttrain pads to the batch's longest row (or packs)"),
    Rule("train_on_inputs", "data.mask_inputs", SAME, value=lambda v: not v),
    Rule("wandb_*", "wandb.*", SAME, apply=_wandb),
    Rule("micro_batch_size", "micro_batch_size", SAME),
    Rule("eval_batch_size", "", NOT_NEEDED, "evaluation uses micro_batch_size"),
    Rule("num_epochs", "epochs", SAME, apply=epochs),
    Rule("optimizer", "optimizer.type", SAME, apply=optimizer_name),
    Rule("lr_scheduler", "scheduler.name", SAME),
    Rule(
        "cosine_min_lr_ratio",
        "scheduler.scheduler_kwargs.min_lr_rate",
        SAME,
        apply=lambda c, k, v: (
            c.set("scheduler.name", "cosine_with_min_lr", k)
            or c.set("scheduler.scheduler_kwargs.min_lr_rate", v, k)
            or "scheduler.name: cosine_with_min_lr, scheduler_kwargs.min_lr_rate"
        ),
    ),
    Rule("bf16", "model.dtype", SAME, apply=_bf16),
    Rule("fp16", "model.dtype", SAME, apply=_bf16),
    Rule("flash_attention", "model.attn_implementation", SAME, apply=_flash),
    Rule("sdp_attention", "model.attn_implementation", SAME, apply=_flash),
    Rule("auto_resume_from_checkpoints", "checkpoint[deepspeed].auto_resume", SAME, apply=resume_from),
    Rule(
        "loss_watchdog_*",
        "",
        UNSUPPORTED,
        "no loss watchdog; a non-finite loss stops the run",
        only_if=lambda v: v is None,
    ),
    Rule("evals_per_epoch", "eval_interval", SAME, apply=_per_epoch("evals")),
    Rule("saves_per_epoch", "checkpoint[deepspeed].save_every_n_steps", SAME, apply=_per_epoch("saves")),
    Rule("special_tokens.*", "", SAME, apply=_special_tokens),
    Rule("tokens", "", UNSUPPORTED, "posttrain adds no tokens to the vocabulary", only_if=lambda v: not v),
    Rule(
        "plugins",
        "",
        UNSUPPORTED,
        "Axolotl plugins (Liger, cut cross-entropy) are not used; "
        "tiled_loss_compute: true bounds the logits' memory",
        only_if=lambda v: not v,
    ),
    Rule("liger_*", "", UNSUPPORTED, "Liger kernels are not used", only_if=lambda v: not v),
    Rule(
        "unfrozen_parameters",
        "",
        UNSUPPORTED,
        "freeze by name is not built in (LoRA or full)",
        only_if=lambda v: not v,
    ),
    Rule("hub_model_id", "", NOT_NEEDED, "posttrain never uploads"),
    Rule("early_stopping_patience", "", UNSUPPORTED, "no early stopping", only_if=lambda v: not v),
    Rule("trl.beta", "beta", SAME),
    *grpo_rules("trl."),
    Rule("trl.*", "", UNSUPPORTED, "a TRL setting with no posttrain equivalent"),
    *training_arguments(),
    Rule(
        "dataset_exact_deduplication", "", UNSUPPORTED, "rows are not deduplicated", only_if=lambda v: not v
    ),
    Rule("save_safetensors", "", NOT_NEEDED, "exports are safetensors"),
)

AXOLOTL = System(
    name="axolotl",
    title="Axolotl",
    rules=RULES,
    defaults=(
        ("epochs", 1, "Axolotl's default num_epochs"),
        ("optimizer.weight_decay", 0.0, "Axolotl's default weight_decay"),
        ("scheduler.warmup_ratio", 0.0, "Axolotl warms up only when asked"),
        ("data.max_length", 2048, "Axolotl's default sequence_len"),
    ),
    finish=_finish,
)
