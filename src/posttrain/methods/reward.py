"""Reward models (``type: reward``): a scalar head on a causal LM trained on preference pairs.

The loss is Bradley-Terry's, ``-log sigmoid(r_chosen - r_rejected - margin)`` per pair (the margin from the
data's ``margin`` column, else 0), plus TRL's ``center_rewards_coefficient x (r_chosen + r_rejected)^2`` when
set; a mean over pairs. Metrics as TRL's RewardTrainer: pairwise ``accuracy`` (the chosen answer scored
strictly higher) and ``margin`` (mean ``r_chosen - r_rejected``), with the mean chosen and rejected
rewards. The export is a sequence-classification checkpoint: ``AutoModelForSequenceClassification``
loads it, and grpo can score completions with it (``rewards: [{model: path}]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from posttrain.config.reward import RewardDataConfig, RewardTrainerConfig
from posttrain.context import RunContext
from posttrain.data.build import DataFactory, Datasets
from posttrain.data.dpo import (
    MARGIN,
    PAIR_COLUMNS,
    PairCollator,
    fit_pair,
    format_pair,
    pair_margin,
    pair_row,
)
from posttrain.data.store import loop_format
from posttrain.models.reward_model import sequence_scores, set_pad_token

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.registry import LossFunction
    from posttrain.training.engine import Engine


def bradley_terry(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor, center: float | None
) -> torch.Tensor:
    """Each pair's loss: ``-ls(r_c - r_r - margin) [+ center (r_c + r_r)^2]`` (TRL's RewardTrainer)."""
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center is not None:
        loss = loss + center * (chosen + rejected) ** 2
    return loss


def make_reward_loss(
    config: RewardTrainerConfig, tokenizer: PreTrainedTokenizerBase | None = None, steps: object = None
) -> LossFunction:
    """reward's ``loss`` hook (``registry.LossBuilder``): Bradley-Terry on each pair's scores, summed."""

    def reward_loss(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        scores = sequence_scores(model, batch).double()
        half = scores.shape[0] // 2
        chosen, rejected = scores[:half], scores[half:]
        losses = bradley_terry(chosen, rejected, batch["margin"], config.center_rewards_coefficient)
        weight = batch["pair_weight"]
        metrics = {
            "accuracy": ((chosen > rejected).double() * weight).sum(),
            "margin": ((chosen - rejected).detach() * weight).sum(),
            "rewards/chosen": (chosen.detach() * weight).sum(),
            "rewards/rejected": (rejected.detach() * weight).sum(),
        }
        return (losses * weight).sum(), metrics

    return reward_loss


def prepare_head(ctx: RunContext, engine: Engine, data: Datasets, collator: PairCollator) -> None:
    """reward's ``prepare`` hook (``registry.Prepare``): the score is read at each row's last token that is
    not the collator's padding, in training and in the export, whose config carries the same pad id."""
    set_pad_token(engine.module, collator.pad_id)


def format_reward_row(row: dict[str, Any], tokenizer: Any, config: RewardDataConfig) -> dict[str, Any]:
    pair = format_pair(
        row, tokenizer, config.max_prompt_length, config.prompt_truncation, config.check_end_of_turn
    )
    pair[MARGIN] = pair_margin(pair_row(row))
    return pair


#: the ``reward`` data factory (registered in ``posttrain.builtins``)
DATA = DataFactory(
    format_batch=loop_format(format_reward_row),
    columns=(*PAIR_COLUMNS, MARGIN),
    fit=fit_pair,
    parts={
        "": "each answer's tokens; its score is read at its last token",
        "chosen_": "chosen (to score higher)",
        "rejected_": "rejected (to score lower)",
    },
)
