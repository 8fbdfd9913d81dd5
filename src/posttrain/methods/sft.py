"""Supervised fine-tuning: chat rows, assistant-only labels, summed next-token cross-entropy.

The loss returns a *sum* over target tokens; the loop divides by the number of target tokens in the whole
optimizer step (all micro-batches, all ranks), so gradient accumulation and data parallelism give the same
update as one large batch.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from posttrain.config.trainer import TrainerConfig
from posttrain.data.build import DataFactory
from posttrain.data.sft import format_sft_rows
from posttrain.models.token_logps import row_nll

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.registry import LossFunction


def sft_loss(
    model: torch.nn.Module, batch: dict[str, Any], tiled: bool | str = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """The summed next-token NLL over the labelled positions (SFT and causal)."""
    return row_nll(model, batch, tiled).sum(), {}


def make_token_loss(
    config: TrainerConfig, tokenizer: PreTrainedTokenizerBase | None = None, steps: object = None
) -> LossFunction:
    """sft's and causal's ``loss`` hook (``registry.LossBuilder``): ``sft_loss`` with the run's
    ``tiled_loss_compute`` (plain, tiled, or chosen by length)."""
    return partial(sft_loss, tiled=config.tiled_loss_compute)


#: the ``sft`` data factory (registered in ``posttrain.builtins``)
DATA = DataFactory(format_batch=format_sft_rows)
