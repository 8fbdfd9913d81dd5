"""Continued pretraining (``type: causal``): next-token loss on every token of raw text."""

from __future__ import annotations

from posttrain.config.data import CausalDataConfig
from posttrain.config.trainer import TrainerConfig
from posttrain.data.build import DataFactory
from posttrain.data.causal import assemble_documents, format_causal_rows, keep_document
from posttrain.methods.sft import make_token_loss
from posttrain.registry import DATA_FACTORIES, TRAINERS, TrainerSpec, hf_components

DATA_FACTORIES.add(
    "causal",
    DataFactory(format_batch=format_causal_rows, fit=keep_document, assemble=assemble_documents, chat=False),
    config=CausalDataConfig,
)

TRAINERS.add(
    "causal",
    TrainerSpec(
        name="causal",
        accepts=hf_components("causal"),
        loss=make_token_loss,
        description="(continued) pretraining on raw text",
    ),
    config=TrainerConfig,
)
