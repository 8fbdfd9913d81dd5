"""LLaMA-Factory configs (``llamafactory-cli train config.yaml``): ``stage``, ``finetuning_type``,
``lora_rank``/``lora_target``, ``pref_beta``/``pref_loss``, ``dataset`` names looked up in
``<dataset_dir>/dataset_info.json``, ``template``, ``cutoff_len``, with the ``TrainingArguments`` names it
passes through."""

from __future__ import annotations

import json
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
    attention,
    vision_freezes,
)
from posttrain.convert.hf_args import (
    TRAINING_ARGUMENTS_DEFAULTS,
    chat_template,
    finish_adapter,
    finish_training_arguments,
    held_out_share,
    near,
    peft_key,
    quant_key,
    training_arguments,
)

#: LLaMA-Factory's stages and posttrain's trainers
STAGES = {"sft": "sft", "pt": "causal", "dpo": "dpo", "kto": "kto", "rm": "reward"}
#: ``pref_loss`` names and posttrain's DPO-family loss types
PREF_LOSSES = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo"}


def _stage(conv: Conversion, key: str, value: Any) -> str:
    if value not in STAGES:
        raise Unsupported(
            f"posttrain trains the stages {', '.join(STAGES)} (ppo: use type grpo with rewards)"
        )
    conv.set("type", STAGES[value], key)
    return f"type: {STAGES[value]}"


def _finetuning(conv: Conversion, key: str, value: Any) -> str:
    if value == "full":
        return "full fine-tuning"
    if value == "lora":
        conv.scratch["lora"] = True
        return "model.peft_config (LoRA)"
    raise Unsupported("freeze (train the last layers only) is not built in; use lora or full")


def _lora_target(conv: Conversion, key: str, value: Any) -> str:
    names = [n.strip() for n in str(value).split(",") if n.strip()] if isinstance(value, str) else list(value)
    target: Any = "all-linear" if names == ["all"] else names
    conv.set("model.peft_config.target_modules", target, key)
    return f"model.peft_config.target_modules: {target}"


def _pref_loss(conv: Conversion, key: str, value: Any) -> str:
    if value not in PREF_LOSSES:
        raise Unsupported(f"posttrain's preference losses for pref_loss are {', '.join(PREF_LOSSES)}")
    conv.set("loss_type", PREF_LOSSES[value], key)
    return "loss_type"


def _quantization_bit(conv: Conversion, key: str, value: Any) -> str:
    if value in (None, 0):
        return "no quantisation"
    if int(value) not in (4, 8):
        raise Unsupported("bitsandbytes loads 4 or 8 bits")
    conv.set(f"model.quantization_config.load_in_{int(value)}bit", True, key)
    if int(value) == 4:
        conv.set("model.quantization_config.bnb_4bit_quant_type", "nf4", key)
    return f"model.quantization_config.load_in_{int(value)}bit (QLoRA: bitsandbytes on a CUDA GPU)"


def _flash_attn(conv: Conversion, key: str, value: Any) -> str:
    kernels = {"fa2": "flash_attention_2", "fa3": "flash_attention_3", "sdpa": "sdpa", "disabled": "eager"}
    if value == "auto":
        return "transformers' choice (posttrain: sdpa)"
    if value not in kernels:
        raise Unsupported(f"one of auto, {', '.join(kernels)}")
    return attention(conv, key, kernels[value])


def _freeze(name: str) -> Any:
    def apply(conv: Conversion, key: str, value: Any) -> str:
        conv.scratch.setdefault("freeze", {})[name] = bool(value)
        return name

    return apply


def _dataset_rows(entry: dict[str, Any]) -> dict[str, Any]:
    """``columns``/``roles`` of a posttrain source for a ``dataset_info.json`` entry."""
    out: dict[str, Any] = {}
    columns = dict(entry.get("columns") or {})
    tags = entry.get("tags") or {}
    messages = columns.pop("messages", None)
    if entry.get("formatting") == "sharegpt":
        chat = tags.get("role_tag", "from") == "role" and tags.get("content_tag", "value") == "content"
        ours = "messages" if chat else "conversations"
        mapping = {ours: messages or "conversations"}
        if not chat:
            mapping |= {"from": tags.get("role_tag", "from"), "value": tags.get("content_tag", "value")}
            roles = {tags.get("user_tag", "human"): "human", tags.get("assistant_tag", "gpt"): "gpt"}
            out["roles"] = {k: v for k, v in roles.items() if k != v}
        out["columns"] = {k: v for k, v in mapping.items() if k != v}
    for ours, theirs in (
        ("instruction", "prompt"),
        ("input", "query"),
        ("output", "response"),
        ("system", "system"),
    ):
        if columns.get(theirs) and columns[theirs] != ours:
            out.setdefault("columns", {})[ours] = columns[theirs]
    if columns.get("kto_tag"):
        out.setdefault("columns", {})["label"] = columns["kto_tag"]
    return {k: v for k, v in out.items() if v}


def _datasets(conv: Conversion, key: str, value: Any) -> str:
    """``dataset: a,b``: each name's entry in ``<dataset_dir>/dataset_info.json`` (found beside the config
    or under the working directory) gives its file and row layout; without the file, the names are kept as
    paths under the dataset directory."""
    names = [n.strip() for n in str(value).split(",") if n.strip()] if isinstance(value, str) else list(value)
    folder = str(conv.scratch.get("dataset_dir", "data"))
    found = near(conv, f"{folder}/dataset_info.json")
    info: dict[str, Any] = {}
    if found is not None:
        try:
            info = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise Unsupported(f"cannot read {found}: {exc}") from None
    sources, missing = [], []
    for name in names:
        entry = info.get(name)
        if entry is None:
            missing.append(name)
            sources.append({"name_or_path": f"{folder}/{name}"})
            continue
        where = entry.get("file_name") and str(found.parent / entry["file_name"]) if found else None
        source: dict[str, Any] = {
            "name_or_path": where or entry.get("hf_hub_url") or entry.get("ms_hub_url") or name
        }
        if entry.get("split"):
            source["split"] = entry["split"]
        sources.append(source | _dataset_rows(entry))
    side = "eval_sources" if key == "eval_dataset" else "sources"
    conv.set(f"data.{side}", sources, key)
    if side == "eval_sources":
        conv.scratch["has_eval"] = True
    if missing:
        where = found or f"{folder}/dataset_info.json"
        conv.line(
            f"({key})",
            UNSUPPORTED,
            f"{', '.join(missing)} not in {where}: kept as paths under {folder}/; point them at the files",
        )
    return f"data.{side} ({len(sources)} from {found or 'the names'})"


def _unwrap(data: dict[str, Any], conv: Conversion) -> dict[str, Any]:
    conv.scratch["dataset_dir"] = data.get("dataset_dir") or "data"  # read before the dataset names
    return data


def _finish(conv: Conversion) -> None:
    conv.config.setdefault("type", "sft")
    if conv.scratch.get("max_samples"):
        for side in ("sources", "eval_sources"):
            for source in conv.get(f"data.{side}", []):
                source["sample_count"] = int(conv.scratch["max_samples"])
    freeze = conv.scratch.get("freeze")
    if freeze:
        frozen = {
            "model.freeze_vision_tower": freeze.get("freeze_vision_tower", True),
            "model.freeze_multi_modal_projector": freeze.get("freeze_multi_modal_projector", True),
            "model.freeze_language_model": freeze.get("freeze_language_model", False),
        }
        conv.line("(model.freeze_*)", SAME, vision_freezes(conv, frozen, "freeze settings"))
    lora = bool(conv.scratch.get("lora"))
    if lora and not conv.has("model.peft_config.lora_alpha"):  # LLaMA-Factory: alpha = 2 x rank
        rank = conv.get("model.peft_config.r", 8)
        conv.set(
            "model.peft_config.lora_alpha", 2 * rank, "LLaMA-Factory's default lora_alpha: 2 x lora_rank"
        )
    finish_adapter(conv, lora, "finetuning_type is not lora", target_default="all-linear", rank_default=8)
    if lora and not conv.has("model.peft_config.lora_dropout"):
        conv.set("model.peft_config.lora_dropout", 0.0, "LLaMA-Factory's default lora_dropout")
    finish_training_arguments(conv, bool(conv.scratch.get("has_eval")))


RULES = (
    Rule("model_name_or_path", "model.name_or_path", SAME),
    Rule("trust_remote_code", "model.trust_remote_code", SAME),
    Rule("model_revision", "model.revision", SAME),
    Rule("adapter_name_or_path", "model.peft_pretrained", SAME),
    Rule("cache_dir", "", NOT_NEEDED, "offline: models and data come from local paths"),
    Rule("stage", "type", SAME, apply=_stage),
    Rule("finetuning_type", "model.peft_config", SAME, apply=_finetuning),
    Rule("lora_rank", "model.peft_config.r", SAME, apply=peft_key("r")),
    Rule("lora_alpha", "model.peft_config.lora_alpha", SAME, apply=peft_key("lora_alpha")),
    Rule("lora_dropout", "model.peft_config.lora_dropout", SAME, apply=peft_key("lora_dropout")),
    Rule("lora_target", "model.peft_config.target_modules", SAME, apply=_lora_target),
    Rule("additional_target", "model.peft_config.modules_to_save", SAME, apply=peft_key("modules_to_save")),
    Rule("use_rslora", "model.peft_config.use_rslora", SAME, apply=peft_key("use_rslora")),
    Rule("use_dora", "model.peft_config.use_dora", SAME, apply=peft_key("use_dora")),
    Rule("pissa_init", "", UNSUPPORTED, "PiSSA initialisation is not built in", only_if=lambda v: not v),
    Rule("quantization_bit", "model.quantization_config", SAME, apply=_quantization_bit),
    Rule(
        "quantization_method",
        "",
        UNSUPPORTED,
        "posttrain quantises with bitsandbytes only",
        only_if=lambda v: v in (None, "bitsandbytes", "bnb"),
    ),
    Rule(
        "double_quantization",
        "model.quantization_config.bnb_4bit_use_double_quant",
        SAME,
        apply=quant_key("bnb_4bit_use_double_quant"),
    ),
    Rule("freeze_vision_tower", "model.freeze_vision_tower", SAME, apply=_freeze("freeze_vision_tower")),
    Rule(
        "freeze_multi_modal_projector",
        "model.freeze_multi_modal_projector",
        SAME,
        apply=_freeze("freeze_multi_modal_projector"),
    ),
    Rule(
        "freeze_language_model", "model.freeze_language_model", SAME, apply=_freeze("freeze_language_model")
    ),
    Rule(
        "image_max_pixels",
        "",
        APPROX,
        "the processor's own image size applies (set it in the checkpoint's preprocessor_config.json)",
    ),
    Rule("image_min_pixels", "", APPROX, "the processor's own image size applies"),
    Rule("video_*", "", NOT_NEEDED, "video rows are not supported; images are"),
    Rule("pref_beta", "beta", SAME),
    Rule("pref_loss", "loss_type", SAME, apply=_pref_loss),
    Rule("pref_ftx", "sft_loss_ratio", SAME),
    Rule("simpo_gamma", "simpo_gamma", SAME),
    Rule("kto_chosen_weight", "desirable_weight", SAME),
    Rule("kto_rejected_weight", "undesirable_weight", SAME),
    Rule("dataset_dir", "data.sources", SAME, apply=lambda c, k, v: "where dataset_info.json is read"),
    Rule("dataset", "data.sources", SAME, apply=_datasets),
    Rule("eval_dataset", "data.eval_sources", SAME, apply=_datasets),
    Rule("template", "tokenizer.chat_template", SAME, apply=chat_template(keep_unknown=True)),
    Rule("cutoff_len", "data.max_length", SAME),
    Rule(
        "max_samples",
        "data.sources[].sample_count",
        APPROX,
        "posttrain samples at random; LLaMA-Factory keeps the first rows",
        apply=lambda c, k, v: c.scratch.update(max_samples=v) or "data.sources[].sample_count",
    ),
    Rule("overwrite_cache", "", NOT_NEEDED, "posttrain's cache is keyed by the data and the settings"),
    Rule("preprocessing_num_workers", "data.num_proc", SAME),
    Rule("tokenized_path", "data.cache_dir", SAME),
    Rule("streaming", "", UNSUPPORTED, "rows are read and cached once", only_if=lambda v: not v),
    Rule("val_size", "data.train_eval_split", SAME, apply=held_out_share),
    Rule("packing", "data.pack_samples", SAME),
    Rule("neat_packing", "data.pack_samples", SAME, "posttrain's packing attends per document always"),
    Rule("train_on_prompt", "data.mask_inputs", SAME, value=lambda v: not v),
    Rule("mask_history", "", UNSUPPORTED, "every assistant turn is trained", only_if=lambda v: not v),
    Rule("flash_attn", "model.attn_implementation", SAME, apply=_flash_attn),
    Rule(
        "enable_liger_kernel",
        "",
        UNSUPPORTED,
        "Liger kernels are not used; tiled_loss_compute: true bounds the logits' memory",
        only_if=lambda v: not v,
    ),
    Rule("use_unsloth", "", UNSUPPORTED, "Unsloth's kernels are not used", only_if=lambda v: not v),
    Rule("disable_gradient_checkpointing", "model.disable_activation_checkpoint", SAME),
    Rule(
        "rope_scaling",
        "model.hf_config_kwargs.rope_scaling",
        UNSUPPORTED,
        "set model.hf_config_kwargs.rope_scaling to the full mapping",
        only_if=lambda v: v is None,
    ),
    Rule("resize_vocab", "", UNSUPPORTED, "the vocabulary is the checkpoint's", only_if=lambda v: not v),
    Rule("new_special_tokens", "", UNSUPPORTED, "posttrain adds no tokens", only_if=lambda v: not v),
    Rule("plot_loss", "", NOT_NEEDED, "posttrain plot draws the loss from the metrics file"),
    Rule("include_num_input_tokens_seen", "", NOT_NEEDED, "tokens are counted in the metrics"),
    Rule("infer_backend", "", NOT_NEEDED, "a chat/export setting"),
    *training_arguments(),
)

LLAMA_FACTORY = System(
    name="llama-factory",
    title="LLaMA-Factory",
    rules=RULES,
    defaults=(
        ("epochs", 3, "TrainingArguments' default num_train_epochs"),
        *TRAINING_ARGUMENTS_DEFAULTS,
        ("data.max_length", 2048, "LLaMA-Factory's default cutoff_len"),
        ("data.mask_inputs", True, "LLaMA-Factory trains on the answers (train_on_prompt: false)", ("sft",)),
        ("beta", 0.1, "LLaMA-Factory's default pref_beta", ("dpo", "kto")),
    ),
    unwrap=_unwrap,
    finish=_finish,
)
