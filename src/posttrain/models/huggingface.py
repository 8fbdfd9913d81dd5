"""Model factory ``huggingface``: ``AutoModelForCausalLM`` from a local path or hub name."""

from __future__ import annotations

import torch

from posttrain.config.model import ModelConfig
from posttrain.context import RunContext
from posttrain.registry import MODEL_FACTORIES

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_config(name_or_path: str):  # -> transformers.PretrainedConfig
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path)


@MODEL_FACTORIES.register("huggingface", config=ModelConfig)
def build_huggingface_model(config: ModelConfig, ctx: RunContext) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        config.name_or_path,
        dtype=TORCH_DTYPES[config.dtype],
        attn_implementation=config.attn_implementation,
    )
    apply_activation_checkpointing(model, config)
    return model


def apply_activation_checkpointing(model: torch.nn.Module, config: ModelConfig) -> None:
    """Gradient checkpointing unless ``disable_activation_checkpoint`` (and the KV cache off in training)."""
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    if not config.disable_activation_checkpoint and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
