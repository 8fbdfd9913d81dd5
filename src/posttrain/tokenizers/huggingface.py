"""Tokenizer factory ``huggingface``: ``AutoTokenizer`` from the tokenizer (or model) path."""

from __future__ import annotations

from typing import Any

from posttrain.config.tokenizer import TokenizerConfig
from posttrain.context import RunContext
from posttrain.errors import UserError
from posttrain.registry import TOKENIZER_FACTORIES


@TOKENIZER_FACTORIES.register("huggingface", config=TokenizerConfig)
def build_huggingface_tokenizer(config: TokenizerConfig, ctx: RunContext) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.name_or_path or ctx.config.model.name_or_path)
    if tokenizer.pad_token_id is None:
        raise UserError(
            f"tokenizer {config.name_or_path!r} has no pad token; add one to the tokenizer "
            "(pad-token strategies arrive with issue #5)"
        )
    return tokenizer
