"""TRL configs: the YAML (or JSON) a ``trl sft --config`` (dpo, grpo, kto) run reads, as the alignment handbook
and open-r1 publish them: ``ModelConfig`` + ``ScriptArguments`` + the trainer's config (``SFTConfig``,
``DPOConfig``, ``GRPOConfig``, ``KTOConfig``, all ``TrainingArguments``), flat. The file does not say which
trainer reads it; the trainer's own keys do (``num_generations`` is GRPO's, ``beta`` DPO's...), and the
report says which was taken."""

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
    attention,
    model_dtype,
    placeholder_data,
    process_count,
    remember,
    to,
)
from posttrain.convert.hf_args import (
    TRAINING_ARGUMENTS_DEFAULTS,
    chat_template,
    finish_adapter,
    finish_training_arguments,
    lora_rules,
    preference_loss,
    quant_key,
    training_arguments,
)

#: keys only GRPOConfig has, and the GRPOConfig keys posttrain's grpo trainer spells the same
GRPO_ONLY = ("num_generations", "reward_funcs", "reward_weights", "max_completion_length", "use_vllm")
GRPO_SAME = (
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "scale_rewards",
    "mask_truncated_completions",
    "importance_sampling_level",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_enable_sleep_mode",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "log_completions",
)
KTO_ONLY = ("desirable_weight", "undesirable_weight")
DPO_ONLY = ("beta", "rpo_alpha", "reference_free", "label_smoothing", "loss_weights", "ref_model_init_kwargs")
GRPO_LOSSES = ("grpo", "dapo", "dr_grpo", "bnpo")


def trainer_type(keys: set[str]) -> tuple[str, str]:
    """The trainer a TRL file is for, and why."""
    for name, marks in (("grpo", GRPO_ONLY), ("kto", KTO_ONLY), ("dpo", DPO_ONLY)):
        found = sorted(keys & set(marks))
        if found:
            return name, f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} {name.upper()}Config's"
    return "sft", "no DPOConfig, KTOConfig or GRPOConfig key: an SFTConfig"


def _unwrap(data: dict[str, Any], conv: Conversion) -> dict[str, Any]:
    kind, why = trainer_type(set(data))
    conv.scratch["type"] = kind
    conv.set("type", kind, "the trainer's own keys")
    conv.line("(type)", APPROX, f"{kind}: {why}; change type if the file is for another trainer")
    return data


def _loss_type(conv: Conversion, key: str, value: Any) -> str:
    if conv.scratch.get("type") != "grpo":
        return preference_loss(conv, key, value)
    if (
        value == "bnpo"
    ):  # BNPO normalises by the batch's tokens, as posttrain's dapo does with one micro-batch
        conv.set("loss_type", "dapo", key)
        return "loss_type: dapo (BNPO's token normalisation over the whole batch)"
    if value not in GRPO_LOSSES:
        raise Unsupported(f"posttrain's grpo loss types are {', '.join(GRPO_LOSSES[:3])} and reinforce")
    conv.set("loss_type", value, key)
    return "loss_type"


def _dataset_name(conv: Conversion, key: str, value: Any) -> str:
    conv.scratch["dataset"] = value
    return "data.sources (a hub name, a data directory or a file)"


def _mixture(conv: Conversion, key: str, value: Any) -> str:
    """The alignment handbook's ``dataset_mixture``: ``datasets`` of {id, config, split, columns, weight}
    (``weight``: the share of that dataset kept), concatenated; ``test_split_size`` held out."""
    if not isinstance(value, dict) or not isinstance(value.get("datasets"), list):
        raise Unsupported("expected {datasets: [{id, split, weight}], test_split_size, seed}")
    sources = []
    for item in value["datasets"]:
        source: dict[str, Any] = {"name_or_path": item["id"]}
        if item.get("split"):
            source["split"] = item["split"]
        weight = float(item.get("weight", 1.0))
        if 0 < weight < 1:
            source["sample_ratio"] = weight
            source["sample_seed"] = int(value.get("seed", 42))
        sources.append(source)
    conv.set("data.sources", sources, key)
    held = value.get("test_split_size")
    extra = ""
    if held and float(held) < 1:
        conv.set("data.train_eval_split", [round(1 - float(held), 6), float(held)], key)
        conv.set("data.split_seed", int(value.get("seed", 42)), key)
        conv.scratch["has_eval"] = True
    elif held:
        extra = f"; test_split_size {held} is a count of rows: set data.train_eval_split to the share it is"
    return f"data.sources ({len(sources)}, concatenated; a weight below 1 keeps that share){extra}"


def _finish(conv: Conversion) -> None:
    kind = conv.scratch["type"]
    name = conv.scratch.get("dataset")
    if name is not None:
        source: dict[str, Any] = {"name_or_path": name}
        if conv.scratch.get("train_split"):
            source["split"] = conv.scratch["train_split"]
        conv.set("data.sources", [source], "dataset_name")
        if conv.scratch.get("test_split") and not conv.scratch.get("no_eval"):
            conv.set(
                "data.eval_sources",
                [{"name_or_path": name, "split": conv.scratch["test_split"]}],
                "dataset_test_split",
            )
            conv.scratch["has_eval"] = True
    if not conv.has("data.sources"):
        placeholder_data(conv, "no dataset_name or dataset_mixture in the file")
    if kind == "sft" and not conv.has("data.mask_inputs"):
        conv.line(
            "(data.mask_inputs)",
            APPROX,
            "posttrain trains the assistant turns (mask_inputs: true); TRL trains every token of messages "
            "rows unless assistant_only_loss (prompt-completion rows: the completion): set false to match",
        )
    finish_adapter(conv, bool(conv.scratch.get("use_peft")), "use_peft is off (full fine-tuning)")
    finish_training_arguments(conv, bool(conv.scratch.get("has_eval")))
    rewards_to_write(conv)


def rewards_to_write(conv: Conversion) -> None:
    """A GRPO config converted without rewards: TRL's (and Axolotl's ``trl:``) reward functions are Python
    names, so the line says to write posttrain's ``rewards:``."""
    if conv.get("type") == "grpo" and not conv.has("rewards"):
        conv.line(
            "(rewards)",
            UNSUPPORTED,
            "TRL passes reward functions in Python: write them under rewards: (type: function, "
            "function: module:name, weight) before training",
        )


def grpo_rules(prefix: str = "") -> tuple[Rule, ...]:
    """GRPOConfig's keys posttrain spells the same, and its reward keys (Python names), under ``prefix``
    (Axolotl's ``trl.``)."""
    return (
        *(Rule(f"{prefix}{name}", name, SAME) for name in GRPO_SAME),
        Rule(
            f"{prefix}reward_funcs",
            "rewards",
            UNSUPPORTED,
            "TRL names Python functions; write them under rewards: (type: function, function: module:name)",
        ),
        Rule(
            f"{prefix}reward_weights",
            "rewards[].weight",
            UNSUPPORTED,
            "a weight per reward: rewards[].weight",
        ),
    )


RULES = (
    # ModelConfig
    Rule("model_name_or_path", "model.name_or_path", SAME),
    Rule("model_revision", "model.revision", SAME),
    Rule("torch_dtype", "model.dtype", SAME, apply=model_dtype),
    Rule("dtype", "model.dtype", SAME, apply=model_dtype),
    Rule("attn_implementation", "model.attn_implementation", SAME, apply=attention),
    Rule("trust_remote_code", "model.trust_remote_code", SAME),
    Rule("use_peft", "model.peft_config", SAME, apply=remember("use_peft", "model.peft_config (LoRA)")),
    Rule(
        "lora_task_type",
        "",
        SAME,
        apply=accept(("CAUSAL_LM",), "posttrain trains causal language models", "implied (CAUSAL_LM)"),
    ),
    *lora_rules(),
    Rule(
        "use_bnb_nested_quant",
        "model.quantization_config.bnb_4bit_use_double_quant",
        SAME,
        apply=quant_key("bnb_4bit_use_double_quant"),
    ),
    Rule(
        "model_init_kwargs",
        "",
        UNSUPPORTED,
        "from_pretrained arguments are model.* keys",
        only_if=lambda v: not v,
    ),
    # ScriptArguments
    Rule("dataset_name", "data.sources", SAME, apply=_dataset_name),
    Rule("dataset_mixture", "data.sources", SAME, apply=_mixture, whole=True),
    Rule(
        "dataset_config",
        "",
        UNSUPPORTED,
        "a hub configuration name: point dataset_name at that configuration's files",
        only_if=lambda v: v in (None, "default"),
    ),
    Rule(
        "dataset_configs", "", NOT_NEEDED, "hub configuration names: the data files are named by data.sources"
    ),
    Rule(
        "dataset_train_split",
        "data.sources[].split",
        SAME,
        apply=remember("train_split", "data.sources[].split"),
    ),
    Rule("dataset_test_split", "data.eval_sources", SAME, apply=remember("test_split", "data.eval_sources")),
    Rule("dataset_streaming", "", UNSUPPORTED, "rows are read and cached once", only_if=lambda v: not v),
    Rule("dataset_num_proc", "data.num_proc", SAME),
    Rule(
        "num_processes",
        "--nproc",
        SAME,
        apply=process_count,
    ),
    Rule("gradient_checkpointing_use_reentrant", "", NOT_NEEDED, "posttrain checkpoints without re-entrance"),
    Rule("ignore_bias_buffers", "", NOT_NEEDED, "DeepSpeed broadcasts no buffers"),
    Rule("env", "", UNSUPPORTED, "set the environment in the launch, not the config", whole=True),
    # SFTConfig
    Rule("max_length", "data.max_length", SAME),
    Rule("max_seq_length", "data.max_length", SAME),
    Rule("packing", "data.pack_samples", SAME),
    Rule("padding_free", "data.padding_free", SAME),
    Rule("completion_only_loss", "data.mask_inputs", SAME, value=lambda v: v is not False),
    Rule(
        "assistant_only_loss",
        "data.mask_inputs",
        APPROX,
        "posttrain's mask_inputs trains the assistant turns only, every one of them",
        value=lambda v: bool(v),
    ),
    Rule("dataset_text_field", "data.text_column", APPROX, "read by type: causal (text rows)"),
    Rule("chat_template", "tokenizer.chat_template", SAME, apply=chat_template(keep_unknown=False)),
    Rule("chat_template_path", "tokenizer.chat_template", SAME, apply=chat_template(keep_unknown=False)),
    Rule("dataset_kwargs", "", NOT_NEEDED, "posttrain prepares the rows itself", whole=True),
    Rule(
        "eos_token",
        "",
        UNSUPPORTED,
        "the chat template's end of turn is trained",
        only_if=lambda v: v is None,
    ),
    Rule(
        "pad_token",
        "tokenizer.missing_pad_token_strategy",
        UNSUPPORTED,
        "the tokenizer's pad token is used; tokenizer.missing_pad_token_strategy sets one",
        only_if=lambda v: v is None,
    ),
    Rule(
        "use_liger*",
        "",
        UNSUPPORTED,
        "Liger kernels are not used; tiled_loss_compute: true bounds the logits' memory",
        only_if=lambda v: not v,
    ),
    Rule(
        "neftune_noise_alpha", "", UNSUPPORTED, "NEFTune noise is not built in", only_if=lambda v: v is None
    ),
    # GRPOConfig
    Rule("loss_type", "loss_type", SAME, apply=_loss_type),
    *grpo_rules(),
    Rule("num_completions_to_print", "", NOT_NEEDED, "completions.jsonl holds them all"),
    Rule("vllm_device", "", NOT_NEEDED, "vLLM is colocated or served (vllm_mode)"),
    Rule("vllm_dtype", "", NOT_NEEDED, "the engine runs the trainer's dtype"),
    Rule("generation_batch_size", "", NOT_NEEDED, "a step's prompts are generated together"),
    Rule(
        "steps_per_generation",
        "num_iterations",
        UNSUPPORTED,
        "reuse a batch with num_iterations",
        only_if=lambda v: v in (None, 1),
    ),
    Rule("wandb_log_unique_prompts", "", NOT_NEEDED, "completions.jsonl holds every prompt"),
    # KTOConfig
    *(Rule(name, name, SAME) for name in KTO_ONLY),
    # the rest of TrainingArguments (and DPOConfig)
    *training_arguments(),
    Rule("project_name", "wandb.project", SAME, apply=to("wandb.project")),
)

TRL = System(
    name="trl",
    title="TRL",
    rules=RULES,
    defaults=(
        ("optimizer.lr", 2e-5, "SFTConfig's default learning_rate", ("sft",)),
        ("optimizer.lr", 1e-6, "DPOConfig's and GRPOConfig's default learning_rate", ("dpo", "grpo")),
        *TRAINING_ARGUMENTS_DEFAULTS,
        ("epochs", 3, "TrainingArguments' default num_train_epochs"),
        ("data.max_length", 1024, "SFTConfig's and DPOConfig's default max_length", ("sft", "dpo", "kto")),
        ("micro_batch_size", 8, "TrainingArguments' default per_device_train_batch_size"),
    ),
    unwrap=_unwrap,
    finish=_finish,
)
