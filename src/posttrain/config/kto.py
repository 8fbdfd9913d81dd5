"""Config of the ``kto`` trainer (Kahneman-Tversky optimisation from unpaired feedback) and its data."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from posttrain.config.data import PromptedDataConfig
from posttrain.config.human import HumanFloat
from posttrain.config.trainer import ReferenceTrainerConfig


class KTODataConfig(PromptedDataConfig):
    """Unpaired feedback as TRL keeps it: ``prompt``, ``completion`` and ``label`` (true: desirable, false:
    undesirable), prompt and completion each a message list or a string. Preference pairs (``prompt``,
    ``chosen``, ``rejected`` and the other pair layouts ``dpo`` reads) load too: each pair gives one desirable
    and one undesirable completion."""

    unsupported: ClassVar[dict[str, str]] = {
        "pack_samples": "KTO completions are batched padded, one row each",
        "padding_free": "KTO completions are batched as padded rows",
    }


class KTOTrainerConfig(ReferenceTrainerConfig):
    type: str = "kto"
    """Trainer type."""

    beta: HumanFloat = Field(default=0.1, gt=0.0)
    """Strength of the implicit KL penalty (KTO's beta)."""

    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto (Ethayarajh 2024, eq. 7: each completion's log-ratio against the batch's KL baseline) or
    apo_zero_unpaired (APO-zero on unpaired rows: no KL baseline), as TRL's KTOTrainer."""

    desirable_weight: HumanFloat = Field(default=1.0, ge=0.0)
    """Weight of the desirable completions' losses (KTO's lambda_D)."""

    undesirable_weight: HumanFloat = Field(default=1.0, ge=0.0)
    """Weight of the undesirable completions' losses (KTO's lambda_U). The paper recommends
    ``desirable_weight x desirables / (undesirable_weight x undesirables)`` in [1, 4/3]; the run warns
    outside it."""

    @property
    def needs_reference(self) -> bool:
        return True
