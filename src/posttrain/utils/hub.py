"""Loading from a local checkpoint directory or the Hugging Face Hub, with one clean error when neither has it
(a missing model is a user error, exit 2, like a missing data file — never a traceback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from posttrain.errors import UserError

T = TypeVar("T")


def looks_local(name: str) -> bool:
    """A path rather than a hub name (``org/name``): absolute, relative with ``./``/``../``/``~``, more than
    two segments, or something on disk."""
    return (
        name.startswith(("/", ".", "~"))
        or Path(name).expanduser().exists()
        or len([part for part in name.split("/") if part]) != 2
    )


def not_found(key: str, name: str, error: Exception) -> UserError:
    if looks_local(name):
        where = Path(name).expanduser()
        what = "is not a directory" if not where.exists() else "holds no Hugging Face checkpoint files here"
        return UserError(
            f"{key}={name!r}: {what}; point it at a checkpoint directory (config.json, weights, tokenizer) "
            "or a Hugging Face Hub name"
        )
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return UserError(
        f"{key}={name!r}: not a local directory, and it could not be read from the Hugging Face Hub "
        f"({reason}); check the name, the network (HF_HUB_OFFLINE=1 when there is none), or the token for a "
        "gated model (model.token_env)"
    )


def load_or_explain(key: str, name: str, load: Callable[[], T]) -> T:
    """``load()``, with a missing checkpoint reported as ``not_found``."""
    try:
        return load()
    except OSError as error:
        raise not_found(key, name, error) from None
