"""Config of the ``dpo`` trainer (DPO-family preference tuning) and its data."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BeforeValidator, Field, model_validator

from posttrain.config.base import ModeKeys, Problem
from posttrain.config.data import PromptedDataConfig
from posttrain.config.human import HumanFloat
from posttrain.config.trainer import ReferenceTrainerConfig


class DPODataConfig(PromptedDataConfig):
    """Preference pairs: ``prompt``, ``chosen``, ``rejected`` (or SiloGen's ``*_messages``), each a message
    list or a string."""

    require_scores: bool = False
    """Every pair must carry scores: TRL's ``score_chosen`` and ``score_rejected`` columns, or ERNIEKit's
    ``sort`` (set for you when the loss reads them, ``offset_alpha`` above 0)."""

    unsupported: ClassVar[dict[str, str]] = {
        "pack_samples": "preference pairs are batched as pairs, not packed",
        "padding_free": "preference pairs are batched as padded pairs",
    }


@dataclass(frozen=True)
class LossInfo:
    reference: bool = True
    """It compares against a reference model (else it is reference-free by definition)."""
    options: tuple[str, ...] = ()
    """The trainer keys it reads besides beta."""
    source: str = "TRL"


#: every preference ``loss_type``: the formulas are in ``posttrain.methods.preference_losses``
PREFERENCE_LOSSES: dict[str, LossInfo] = {
    "sigmoid": LossInfo(options=("label_smoothing", "offset_alpha"), source="ERNIEKit, TRL"),
    "hinge": LossInfo(source="ERNIEKit, TRL"),
    "ipo": LossInfo(source="ERNIEKit, TRL"),
    "simpo": LossInfo(
        reference=False, options=("label_smoothing", "simpo_gamma"), source="ERNIEKit, TRL (CPO)"
    ),
    "orpo": LossInfo(reference=False, source="the ORPO paper, TRL's ORPO trainer"),
    "or": LossInfo(reference=False, source="ERNIEKit"),
    "dpop": LossInfo(options=("dpop_lambda",), source="ERNIEKit"),
    "kto_pair": LossInfo(source="ERNIEKit"),
    "sppo_hard": LossInfo(source="ERNIEKit, TRL"),
    "nca_pair": LossInfo(source="ERNIEKit, TRL"),
    "robust": LossInfo(options=("label_smoothing",)),
    "bco_pair": LossInfo(),
    "exo_pair": LossInfo(options=("label_smoothing",)),
    "aot": LossInfo(options=("label_smoothing",)),
    "aot_pair": LossInfo(options=("label_smoothing",)),
    "apo_zero": LossInfo(),
    "apo_down": LossInfo(),
    "discopop": LossInfo(options=("discopop_tau",)),
    "sft": LossInfo(reference=False),
    "sigmoid_norm": LossInfo(),
}
#: TRL's older names
LOSS_ALIASES = {"aot_unpaired": "aot_pair"}


def _loss_names(value: Any) -> Any:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{value!r}: a loss type name or a non-empty list of them")
    unknown = [n for n in names if n not in PREFERENCE_LOSSES and n not in LOSS_ALIASES]
    if unknown:
        allowed = ", ".join(repr(n) for n in PREFERENCE_LOSSES)
        raise ValueError(f"unknown loss type {', '.join(map(repr, unknown))}; allowed: {allowed}")
    return value


LossTypes = Annotated[str | list[str], BeforeValidator(_loss_names)]


def _uses(option: str) -> Any:
    return lambda c, root: any(option in PREFERENCE_LOSSES[n].options for n in c.loss_types)


class DPOTrainerConfig(ReferenceTrainerConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        *ReferenceTrainerConfig.mode_keys,
        *(
            ModeKeys(
                (option,),
                _uses(option),
                "loss_type: " + " or ".join(n for n, i in PREFERENCE_LOSSES.items() if option in i.options),
            )
            for option in ("label_smoothing", "simpo_gamma", "offset_alpha", "dpop_lambda", "discopop_tau")
        ),
        ModeKeys(("reference_free",), lambda c, root: c.uses_reference, "a loss with a reference model"),
        ModeKeys(("loss_weights",), lambda c, root: len(c.loss_types) > 1, "a list of loss types"),
    )
    type: str = "dpo"
    """Trainer type."""

    reference_free: bool = False
    """Compare against a uniform reference (reference log-probabilities of 0) instead of a model."""

    beta: HumanFloat = Field(default=0.1, gt=0.0)
    """Strength of the KL penalty (DPO's beta); for ORPO the weight of the odds-ratio term."""

    loss_type: LossTypes = "sigmoid"
    """The preference loss, or a list of them summed with ``loss_weights`` (TRL's MPO: ``[sigmoid, sft]``):
    sigmoid (DPO), hinge (SLiC), ipo, simpo, orpo, or, dpop, kto_pair, sppo_hard, nca_pair, robust,
    bco_pair, exo_pair, aot, aot_pair, apo_zero, apo_down, discopop, sft, sigmoid_norm. Each one's formula
    and source: docs/methods.md#preference-losses."""

    loss_weights: list[HumanFloat] | None = None
    """One weight per entry of a ``loss_type`` list (null: 1 each), as TRL's ``loss_weights``."""

    label_smoothing: HumanFloat = Field(default=0.0, ge=0.0, lt=0.5)
    """Assumed fraction of flipped preference labels: conservative DPO (sigmoid, simpo, aot, aot_pair),
    robust's noise rate, exo_pair's epsilon (which must then be above 0)."""

    simpo_gamma: HumanFloat = 0.5
    """SimPO's target reward margin gamma."""

    offset_alpha: HumanFloat = Field(default=0.0, ge=0.0)
    """ERNIEKit's score-based offset for sigmoid: the margin is reduced by ``offset_alpha / beta *
    log(score_chosen - score_rejected)``; every pair must then carry scores (TRL's ``score_chosen`` and
    ``score_rejected`` columns, or ERNIEKit's ``sort``)."""

    dpop_lambda: HumanFloat = Field(default=50.0, ge=0.0)
    """dpop's penalty on the chosen answer's log-prob falling below the reference's (ERNIEKit's default 50)."""

    discopop_tau: HumanFloat = Field(default=0.05, gt=0.0)
    """discopop's temperature mixing its logistic and exponential parts (TRL's default)."""

    sft_loss_ratio: HumanFloat = Field(default=0.0, ge=0.0)
    """Weight of the chosen answers' NLL (ERNIEKit) added to the loss: one token mean over the step's chosen
    tokens, all micro-batches and processes (over the micro-batch in evaluation)."""

    pref_loss_ratio: HumanFloat = Field(default=1.0, ge=0.0)
    """Weight of the preference loss (ERNIEKit)."""

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if not self.uses_reference and self.ref_model is not None:
            yield Problem("ref_model", f"loss_type {self.loss_type} is reference-free; remove ref_model")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_types):
            yield Problem(
                "loss_weights",
                f"{len(self.loss_weights)} weights for {len(self.loss_types)} loss types; give one per loss type",
            )
        if "exo_pair" in self.loss_types and self.label_smoothing == 0:
            yield Problem("label_smoothing", "0: exo_pair needs its epsilon above 0 (TRL suggests 1e-3)")
        if "orpo" in self.loss_types and len(self.loss_types) > 1:
            yield Problem("loss_type", "orpo already adds the chosen NLL; list 'or' with 'sft' instead")
        if self.reference_free and self.ref_model is not None:
            yield Problem("ref_model", "reference_free: true uses no reference model; remove ref_model")

    @property
    def loss_types(self) -> tuple[str, ...]:
        names = [self.loss_type] if isinstance(self.loss_type, str) else self.loss_type
        return tuple(LOSS_ALIASES.get(n, n) for n in names)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(self.loss_weights) if self.loss_weights is not None else (1.0,) * len(self.loss_types)

    @property
    def uses_reference(self) -> bool:
        return any(PREFERENCE_LOSSES[n].reference for n in self.loss_types)

    @property
    def needs_reference(self) -> bool:
        return not self.reference_free and self.uses_reference

    @model_validator(mode="after")
    def _scores(self) -> DPOTrainerConfig:
        """The score offset reads every pair's scores: the data build checks each row has them."""
        if isinstance(self.data, DPODataConfig) and self.offset_alpha > 0 and "sigmoid" in self.loss_types:
            self.data.require_scores = True
        return self
