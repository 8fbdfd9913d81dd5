"""Config of the ``dpo`` trainer (DPO-family preference tuning) and its data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

from pydantic import Field

from posttrain.config.base import ModeKeys, Problem
from posttrain.config.data import DataConfig
from posttrain.config.human import HumanFloat, HumanInt
from posttrain.config.model import ModelConfig
from posttrain.config.trainer import TrainerConfig


class DPODataConfig(DataConfig):
    """Preference pairs: ``prompt``, ``chosen``, ``rejected`` (or SiloGen's ``*_messages``), each a message
    list or a string."""

    max_prompt_length: HumanInt = Field(default=0, ge=0)
    """Longest prompt in tokens (0: no limit besides max_length); longer prompts are cut per ``prompt_truncation``."""

    prompt_truncation: Literal["keep_start", "keep_end"] = "keep_end"
    """Which part of an over-long prompt to keep: its first or (default) its last tokens."""

    unsupported: ClassVar[dict[str, str]] = {
        "pack_samples": "preference pairs are batched as pairs, not packed",
        "padding_free": "preference pairs are batched as padded pairs",
    }


class DPOTrainerConfig(TrainerConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        *TrainerConfig.mode_keys,
        ModeKeys(("label_smoothing",), lambda c, root: c.loss_type == "sigmoid", "loss_type: sigmoid"),
        ModeKeys(("simpo_gamma",), lambda c, root: c.loss_type == "simpo", "loss_type: simpo"),
        ModeKeys(
            ("reference_free",),
            lambda c, root: c.loss_type in ("sigmoid", "ipo", "hinge"),
            "a loss with a reference model (sigmoid, ipo, hinge)",
        ),
    )
    type: str = "dpo"
    """Trainer type."""

    ref_model: ModelConfig | None = None
    """The frozen reference model. Null: the policy's initial weights. Its log-probabilities are computed
    once, before training, so it never takes memory or time during training and never gets an optimizer."""

    reference_free: bool = False
    """Compare against a uniform reference (reference log-probabilities of 0) instead of a model."""

    beta: HumanFloat = Field(default=0.1, gt=0.0)
    """Strength of the KL penalty (DPO's beta); for ORPO the weight of the odds-ratio term."""

    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge (SLiC), simpo (length-normalised, reference-free) or orpo (NLL + odds
    ratio, reference-free)."""

    label_smoothing: HumanFloat = Field(default=0.0, ge=0.0, lt=0.5)
    """Assumed fraction of flipped preference labels (conservative DPO; sigmoid and simpo)."""

    simpo_gamma: HumanFloat = 0.5
    """SimPO's target reward margin gamma."""

    sft_loss_ratio: HumanFloat = Field(default=0.0, ge=0.0)
    """Weight of the chosen answer's mean token NLL added to the loss (ERNIEKit)."""

    pref_loss_ratio: HumanFloat = Field(default=1.0, ge=0.0)
    """Weight of the preference loss (ERNIEKit)."""

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.loss_type in ("simpo", "orpo") and self.ref_model is not None:
            yield Problem("ref_model", f"loss_type {self.loss_type} is reference-free; remove ref_model")
        if self.reference_free and self.ref_model is not None:
            yield Problem("ref_model", "reference_free: true uses no reference model; remove ref_model")
        if self.ref_model is not None and self.ref_model.peft_config is not None:
            yield Problem("ref_model.peft_config", "the reference model is frozen; adapters belong on model")
        if self.ref_model is not None and self.ref_model.save_name is not None:
            yield Problem("ref_model.save_name", "the reference model is never saved; remove it")
        if self.sequence_parallel_size > 1:
            yield Problem(
                "sequence_parallel_size",
                f"{self.sequence_parallel_size}: dpo does not support sequence parallelism yet (sft and causal "
                "do); set it to 1",
            )

    @property
    def needs_reference(self) -> bool:
        return not self.reference_free and self.loss_type not in ("simpo", "orpo")
