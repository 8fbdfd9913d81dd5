"""``optimizer:`` — the optimizer and its hyper-parameters."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field

from posttrain.config.base import BaseConfig, ModeKeys, uses_adapters
from posttrain.config.human import HumanFloat, HumanInt


class OptimizerConfig(BaseConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(
            ("lora_plus_scale",), uses_adapters, "LoRA adapters (model.peft_config or model.peft_pretrained)"
        ),
        ModeKeys(
            ("lr_reference_batch_size",),
            lambda c, root: c.lr_batch_size_scaling != "none",
            "optimizer.lr_batch_size_scaling: sqrt or linear",
        ),
    )
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

    layerwise_lr_decay_bound: HumanFloat = Field(default=1.0, gt=0.0, le=1.0)
    """Layer-wise LR decay (ERNIEKit's ``layerwise_lr_decay_bound``): the embeddings train at ``lr`` times
    this, the decoder layers at ratios rising linearly to 1 at the top (final norm and LM head). 1: off."""

    lr_multiplier: HumanFloat = Field(default=1.0, gt=0.0)
    """Multiply ``lr`` by this (SiloGen's ``overrides.lr_multiplier``)."""

    lr_batch_size_scaling: Literal["none", "sqrt", "linear"] = "none"
    """Scale ``lr`` with the global batch size (SiloGen's ``overrides.lr_batch_size_scaling``): ``sqrt``
    multiplies it by sqrt(global batch / ``lr_reference_batch_size``), ``linear`` by that ratio."""

    lr_reference_batch_size: HumanInt = Field(default=1, ge=1)
    """The global batch size ``lr`` was tuned for (1, as in SiloGen, scales by the batch size itself)."""

    def effective_lr(self, global_batch_size: int) -> float:
        """``lr`` after the multiplier and the batch-size scaling."""
        ratio = global_batch_size / self.lr_reference_batch_size
        scale = {"none": 1.0, "sqrt": math.sqrt(ratio), "linear": ratio}[self.lr_batch_size_scaling]
        return self.lr * self.lr_multiplier * scale
