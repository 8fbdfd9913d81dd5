"""Model factory ``huggingface``: ``AutoModelForCausalLM`` (``AutoModelForImageTextToText`` for a
vision-language checkpoint) from a local path or hub name, and its facts from the checkpoint's ``config.json``. The run's transforms are applied by the model stage (``stages.model``)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from posttrain.config.model import ModelConfig
from posttrain.context import RunContext
from posttrain.errors import UserError
from posttrain.models.facts import ModelFacts, facts_from_hf_config
from posttrain.registry import ModelFactory
from posttrain.utils.hub import load_or_explain
from posttrain.vision.processor import auto_model_class

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HuggingFaceModelFactory(ModelFactory):
    """Loads the model (``__call__``) and reports its facts before loading (``facts``), so the run never
    reads the checkpoint's config itself. ``loader(name_or_path, **arguments)`` is ``from_pretrained`` of
    the head the method trains: the causal LM by default, a scalar score for reward models."""

    def __init__(self, loader: Any = None) -> None:
        self.loader = loader

    def facts(self, config: ModelConfig) -> ModelFacts | None:
        """From the checkpoint's ``config.json``; None when it is not a transformers checkpoint."""
        try:
            return facts_from_hf_config(hf_config(config))
        except (OSError, ValueError):
            return None

    def load(self, config: ModelConfig, ctx: RunContext) -> torch.nn.Module:
        check_attention_kernel(config.attn_implementation)
        arguments: dict[str, Any] = {
            "dtype": TORCH_DTYPES.get(config.dtype, "auto"),
            "attn_implementation": config.attn_implementation,
            **config.hub_arguments(),
            **_quantization(config),
        }
        if config.experts_implementation:
            arguments["experts_implementation"] = config.experts_implementation
        default = _auto_class(config)
        try:
            return load_or_explain(
                "model.name_or_path",
                config.name_or_path,
                lambda: (self.loader or default.from_pretrained)(
                    config.name_or_path,
                    **arguments,
                    **({"config": hf_config(config)} if config.hf_config_kwargs else {}),
                ),
            )
        except ValueError as error:
            if "attention implementation" not in str(error):
                raise
            raise UserError(
                f"model.attn_implementation={config.attn_implementation} is not supported by "
                f"{config.name_or_path}'s architecture ({str(error).split('.')[0]}); set "
                "model.attn_implementation: eager (or another kernel the model supports)"
            ) from None

    def __call__(self, config: ModelConfig, ctx: RunContext) -> torch.nn.Module:
        return self.load(config, ctx)


def hf_config(config: ModelConfig) -> Any:  # -> transformers.PretrainedConfig
    """The checkpoint's ``config.json`` with ``model.hf_config_kwargs`` applied: what the facts, the memory
    plan and loading all read."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        config.name_or_path, **config.hub_arguments(), **config.hf_config_kwargs
    )


def _auto_class(config: ModelConfig) -> Any:
    """The auto class for the checkpoint (``vision.processor.auto_model_class``); the causal LM's when its
    config cannot be read here (loading then says why)."""
    try:
        return auto_model_class(hf_config(config))
    except (OSError, ValueError):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM


FACTORY = HuggingFaceModelFactory()


#: the attention kernels that come from a package of their own: the module transformers imports for each
KERNEL_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
}


def check_attention_kernel(attention: str) -> None:
    """A FlashAttention kernel needs its package and a CUDA GPU: refused in one line before loading, with
    sdpa (posttrain's packed rows run as one varlen call per layer on CUDA) as the alternative."""
    if attention not in KERNEL_PACKAGES:
        return
    module, package = KERNEL_PACKAGES[attention]
    why = ""
    if not torch.cuda.is_available():
        why = "needs a CUDA GPU and none is visible"
    elif importlib.util.find_spec(module) is None:
        why = f"needs the {package} package, which is not installed (pip install {package})"
    if why:
        raise UserError(
            f"model.attn_implementation={attention} {why}; set model.attn_implementation: sdpa (posttrain runs "
            "packed rows through it as one varlen call per layer on CUDA)"
        )


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
