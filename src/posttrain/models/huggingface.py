"""Model factory ``huggingface``: ``AutoModelForCausalLM`` from a local path or hub name."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.model import ModelConfig
from posttrain.context import RunContext
from posttrain.errors import UserError
from posttrain.models.peft import apply_peft
from posttrain.registry import MODEL_FACTORIES

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@MODEL_FACTORIES.register("huggingface", config=ModelConfig)
def build_huggingface_model(config: ModelConfig, ctx: RunContext) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        config.name_or_path,
        dtype=TORCH_DTYPES[config.dtype],
        attn_implementation=config.attn_implementation,
        **_quantization(config),
    )
    apply_activation_checkpointing(model, config)
    return apply_peft(model, config.peft_config, config.peft_pretrained)


def _quantization(config: ModelConfig) -> dict[str, Any]:
    """``quantization_config`` for ``from_pretrained``; refused up front where bitsandbytes cannot run."""
    if config.quantization_config is None:
        return {}
    if not torch.cuda.is_available():
        raise UserError(
            "model.quantization_config (QLoRA through bitsandbytes) needs a CUDA GPU and none is visible; "
            "remove quantization_config to train LoRA on the unquantised model"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("model.quantization_config needs bitsandbytes: pip install bitsandbytes") from None
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(**config.quantization_config)}


def apply_activation_checkpointing(model: torch.nn.Module, config: ModelConfig) -> None:
    """Gradient checkpointing unless ``disable_activation_checkpoint`` (and the KV cache off in training)."""
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    if not config.disable_activation_checkpoint and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
