"""``tokenizer:`` — which tokenizer renders and encodes the data, with which chat template and padding."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from posttrain.config.base import BaseConfig
from posttrain.tokenizers.chat_templates import PRESETS


class TokenizerConfig(BaseConfig):
    type: str = ""
    """Tokenizer factory type. Defaults to the trainer's first accepted tokenizer factory (``huggingface``)."""

    name_or_path: str | None = ""
    """Hub name or local directory of the tokenizer. Empty: the model's ``name_or_path``."""

    chat_template: str = Field(
        default="keep-original",
        description=(  # the presets named from their table, so the reference lists every one
            "The chat template: ``keep-original`` (the tokenizer's own), a preset ("
            + ", ".join(f"``{name}``" for name in PRESETS)
            + "; SiloGen's ``chat_template_name``) or a path to a ``.jinja`` file. Presets mark the assistant "
            "turns, so labels come from the template's own mask; their special tokens are added to the tokenizer "
            "(and the model's embeddings grown) when missing. The template is saved with the tokenizer in every "
            "export."
        ),
    )

    missing_pad_token_strategy: Literal[
        "bos-repurpose", "eos-repurpose", "unk-repurpose", "unk-convert-to-eos"
    ] = "bos-repurpose"
    """Only when the tokenizer has no pad token (SiloGen's strategies): pad with BOS, EOS, or UNK, or pad
    with UNK and show EOS on the input side of padding (``unk-convert-to-eos``). Padding is never trained."""

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str) -> str:
        from posttrain.tokenizers.chat_templates import check_choice

        return check_choice(value)
