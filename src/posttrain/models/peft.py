"""PEFT adapters on a loaded model (the config side, ``model.peft_config``, is ``config/peft.py``)."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.peft import peft_config_from_dict
from posttrain.config.trainer import TrainerConfig
from posttrain.vision.freeze import language_adapter_targets


def apply_peft(
    model: torch.nn.Module, peft_config: dict[str, Any] | None, pretrained: str | None
) -> torch.nn.Module:
    """Wrap ``model`` with new adapters, or with the saved adapter at ``pretrained`` (trainable)."""
    from peft import PeftModel, get_peft_model

    if pretrained:
        return PeftModel.from_pretrained(model, pretrained, is_trainable=True)
    if peft_config is not None:
        return get_peft_model(model, peft_config_from_dict(peft_config))
    return model


def base_model(model: Any) -> Any:
    """The model inside a PEFT wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def peft_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: ``model.peft_config`` (new adapters) or ``model.peft_pretrained`` (a saved one, trained on);
    on a vision-language model, new adapters target its language model unless the config names targets."""
    settings = language_adapter_targets(model, config.model.peft_config)
    return apply_peft(model, settings, config.model.peft_pretrained)
