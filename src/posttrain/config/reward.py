"""Config of the ``reward`` trainer (a reward model: a scalar head on a causal LM, trained on preference
pairs) and its data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from pydantic import Field, model_validator

from posttrain.config.base import Problem
from posttrain.config.data import PromptedDataConfig
from posttrain.config.human import HumanFloat
from posttrain.config.trainer import TrainerConfig


class RewardDataConfig(PromptedDataConfig):
    """Preference pairs (every layout ``dpo`` reads: ``prompt``/``chosen``/``rejected``, SiloGen's
    ``*_messages``, ERNIEKit's rows), with TRL's optional ``margin`` column: how much better the chosen answer
    is, subtracted inside the Bradley-Terry loss."""

    unsupported: ClassVar[dict[str, str]] = {
        "pack_samples": "reward pairs are batched as pairs, not packed",
        "padding_free": "reward pairs are batched as padded pairs",
    }


class RewardTrainerConfig(TrainerConfig):
    type: str = "reward"
    """Trainer type."""

    center_rewards_coefficient: HumanFloat | None = Field(default=None, ge=0.0)
    """TRL's: adds ``coefficient x mean((r_chosen + r_rejected)^2)`` to the loss, so the rewards stay centred on
    0 (1e-2 is the value its paper, Eisenstein et al. 2023, uses). Null: off."""

    @model_validator(mode="after")
    def _sequence_classification_adapters(self) -> RewardTrainerConfig:
        """LoRA on a reward model trains the score head whole (PEFT's SEQ_CLS task keeps it trainable and
        saves it with the adapter)."""
        peft = self.model.peft_config
        if peft is not None and "task_type" not in peft:
            self.model.peft_config = {**peft, "task_type": "SEQ_CLS"}
        return self

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.sequence_parallel_size > 1:
            yield Problem(
                "sequence_parallel_size", f"{self.sequence_parallel_size}: reward does not support it yet"
            )
        if self.tiled_loss_compute is True:
            yield Problem(
                "tiled_loss_compute", "true: a reward model has no vocabulary head to tile; remove it"
            )
        if self.model.peft_config is not None and self.model.peft_config.get("task_type") not in (
            None,
            "SEQ_CLS",
        ):
            yield Problem(
                "model.peft_config.task_type", "a reward model's adapters are SEQ_CLS; remove task_type"
            )
