"""What to pad with when the tokenizer has no pad token (SiloGen's missing-pad-token strategies).

posttrain masks padding in the labels by position, never by token id, so every strategy keeps EOS trained
here. The strategies differ in what the saved tokenizer carries afterwards and what the model sees on the
input side of padded positions.
"""

from __future__ import annotations

from typing import Any

from posttrain.errors import UserError
from posttrain.logs import get_logger

STRATEGIES = ("bos-repurpose", "eos-repurpose", "unk-repurpose", "unk-convert-to-eos")

EOS_RISK = (
    "the pad token is now EOS (missing_pad_token_strategy: eos-repurpose). posttrain masks padding by "
    "position, so EOS is still trained here, but any tool that masks labels by pad id (e.g. transformers' "
    "DataCollatorForLanguageModeling) will never train EOS with this tokenizer, and the model never learns to "
    "stop; bos-repurpose avoids that"
)


def ensure_pad_token(tokenizer: Any, strategy: str) -> str | None:
    """Give a tokenizer without a pad token one by ``strategy``; returns a line describing what was done
    (None when the tokenizer already had a pad token)."""
    if tokenizer.pad_token_id is not None:
        return None
    source = {"bos-repurpose": "bos", "eos-repurpose": "eos"}.get(strategy, "unk")
    token = getattr(tokenizer, f"{source}_token", None)
    if token is None:
        raise UserError(
            f"the tokenizer has no pad token and no {source.upper()} token for "
            f"tokenizer.missing_pad_token_strategy={strategy!r}; choose another of {', '.join(STRATEGIES)} "
            "or add a pad token to the tokenizer"
        )
    if strategy == "unk-convert-to-eos" and tokenizer.eos_token_id is None:
        raise UserError(
            "missing_pad_token_strategy 'unk-convert-to-eos' needs an EOS token; the tokenizer has none"
        )
    tokenizer.pad_token = token
    if strategy == "eos-repurpose":
        get_logger().warning(EOS_RISK)
    return f"no pad token: padding with {source.upper()} {token!r} ({strategy})"


def input_pad_id(tokenizer: Any, strategy: str) -> int:
    """The id written into ``input_ids`` at padded positions: EOS under ``unk-convert-to-eos`` (labels there
    stay ignored), else the pad token."""
    converted = strategy == "unk-convert-to-eos" and tokenizer.pad_token_id == tokenizer.unk_token_id
    return tokenizer.eos_token_id if converted else tokenizer.pad_token_id
