"""Token embeddings that follow the tokenizer: a chat-template preset may add special tokens, and the model's
input embeddings (and a tied head) grow to match."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.trainer import TrainerConfig
from posttrain.logs import get_logger, say


def fit_embeddings(model: torch.nn.Module, tokenizer: Any) -> None:
    """Grow the model's token embeddings when the tokenizer gained tokens (chat-template presets)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(embeddings, "num_embeddings", None)
    if size is None or len(tokenizer) <= size:
        return
    model.resize_token_embeddings(len(tokenizer))
    say(f"token embeddings resized from {size} to {len(tokenizer)} for the added special tokens")
    if getattr(model, "peft_config", None):
        get_logger().warning(
            "the added tokens' embeddings are not trained by the adapter; add embed_tokens and lm_head to "
            "peft_config modules_to_save to train them"
        )


def fit_embeddings_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: after the adapters exist, so that the warning about untrained new rows is right."""
    fit_embeddings(model, tokenizer)
    return model
