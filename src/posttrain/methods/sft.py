"""Supervised fine-tuning: chat rows, assistant-only labels, summed next-token cross-entropy.

The loss returns a *sum* over target tokens; the loop divides by the number of target tokens in the whole
optimizer step (all micro-batches, all ranks), so gradient accumulation and data parallelism give the same
update as one large batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttrain.config.data import SFTDataConfig
from posttrain.config.trainer import TrainerConfig
from posttrain.data.build import DataFactory
from posttrain.data.sft import IGNORE_INDEX, format_sft_rows
from posttrain.registry import DATA_FACTORIES, TRAINERS, TrainerSpec, hf_components


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token negative log-likelihoods over labels != -100 (float32 softmax)."""
    shifted_logits = logits[:, :-1, :].reshape(-1, logits.size(-1)).float()
    shifted_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted_logits, shifted_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    keys = ("input_ids", "attention_mask", "position_ids")
    return {key: batch[key] for key in keys if key in batch}


def sft_loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    logits = model(**model_inputs(batch), use_cache=False).logits
    return token_nll_sum(logits, batch["labels"]), {}


DATA_FACTORIES.add("sft", DataFactory(format_batch=format_sft_rows), config=SFTDataConfig)
TRAINERS.add(
    "sft",
    TrainerSpec(
        name="sft",
        accepts=hf_components("sft"),
        loss=lambda config: sft_loss,
        description="supervised fine-tuning on chat data",
    ),
    config=TrainerConfig,
)
