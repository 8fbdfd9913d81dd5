"""Continued pretraining (``type: causal``): next-token loss on every token of raw text."""

from __future__ import annotations

from typing import Any

from posttrain.config.data import CausalDataConfig, DataConfig
from posttrain.config.trainer import TrainerConfig
from posttrain.data.build import DataFactory, DataReport
from posttrain.data.causal import assemble_documents, format_document
from posttrain.methods.sft import sft_loss
from posttrain.registry import DATA_FACTORIES, TRAINERS, TrainerSpec, hf_components


def format_causal_row(row: dict[str, Any], tokenizer: Any, config: DataConfig) -> dict[str, list[int]]:
    assert isinstance(config, CausalDataConfig)
    return format_document(row, tokenizer, config.text_column, config.add_bos, config.add_eos)


def assemble_causal(
    samples: list[dict[str, list[int]]], max_length: int, config: DataConfig, report: DataReport, pack: bool
) -> list[dict[str, list[int]]]:
    report.samples = len(samples)
    return assemble_documents(samples, max_length, config.seed, pack, getattr(config, "packing", "best-fit"))


DATA_FACTORIES.add(
    "causal",
    DataFactory(format=format_causal_row, assemble=assemble_causal, chat=False),
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
