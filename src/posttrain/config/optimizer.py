"""``optimizer:`` — the optimizer and its hyper-parameters."""

from __future__ import annotations

from pydantic import Field

from posttrain.config.base import BaseConfig
from posttrain.config.human import HumanFloat


class OptimizerConfig(BaseConfig):
    type: str = ""
    """Optimizer factory type. Defaults to the trainer's first accepted optimizer (``adamw``: torch AdamW)."""

    weight_decay: HumanFloat = Field(default=0.1, ge=0.0)
    """Decoupled weight decay. Never applied to biases, norm weights or other 1-D parameters."""

    betas: tuple[HumanFloat, HumanFloat] = (0.9, 0.999)
    """Adam's (beta1, beta2): decay rates of the running averages of the gradient and its square."""

    lr: HumanFloat = Field(default=5e-4, ge=0.0, alias="learning_rate")
    """Peak learning rate (``learning_rate`` is accepted as an alias)."""

    eps: HumanFloat = Field(default=1e-8, gt=0.0)
    """Adam's epsilon, added to the denominator for numerical stability."""

    lora_plus_scale: HumanFloat = Field(default=1.0, gt=0.0)
    """LoRA+: the learning rate of the LoRA B matrices is ``lr`` times this (ERNIEKit's ``lora_plus_scale``;
    the LoRA+ paper suggests 16). 1: off."""
