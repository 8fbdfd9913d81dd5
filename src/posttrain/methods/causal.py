"""Continued pretraining (``type: causal``): next-token loss on every token of raw text."""

from __future__ import annotations

from typing import Any

from posttrain.config.data import CausalDataConfig, DataConfig
from posttrain.config.trainer import TrainerConfig
from posttrain.data.build import DataFactory
from posttrain.data.causal import assemble_documents, format_documents
from posttrain.methods.sft import sft_loss
from posttrain.registry import DATA_FACTORIES, TRAINERS, TrainerSpec, hf_components


def format_causal_rows(rows: list[dict[str, Any]], tokenizer: Any, config: DataConfig) -> list[Any]:
    assert isinstance(config, CausalDataConfig)
    return format_documents(rows, tokenizer, config.text_column, config.add_bos, config.add_eos)


def keep_document(sample: dict[str, Any], max_length: int, config: DataConfig) -> tuple[Any, str, bool]:
    return sample, "", False  # long documents are cut into blocks or chunks when assembled


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
        loss=lambda config: sft_loss,
        description="(continued) pretraining on raw text",
    ),
    config=TrainerConfig,
)
