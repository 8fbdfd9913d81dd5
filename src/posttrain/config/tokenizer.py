"""``tokenizer:`` — which tokenizer renders and encodes the data."""

from __future__ import annotations

from posttrain.config.base import BaseConfig


class TokenizerConfig(BaseConfig):
    type: str = ""
    """Tokenizer factory type. Defaults to the trainer's first accepted tokenizer factory (``huggingface``)."""

    name_or_path: str | None = ""
    """Hub name or local directory of the tokenizer. Empty: the model's ``name_or_path``."""
