"""Loading from a local checkpoint directory or the Hugging Face Hub, with one clean error when neither has it
(a missing model is a user error, exit 2, like a missing data file — never a traceback)."""

from __future__ import annotations

import os
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


_REACHABLE: dict[str, bool] = {}


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host (``HF_ENDPOINT``) answers a TCP connection within ``timeout`` seconds; asked
    once per process."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    if host not in _REACHABLE:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _REACHABLE[host] = True
        except OSError:
            _REACHABLE[host] = False
    return _REACHABLE[host]


def offline_unless_reachable(name: str) -> bool:
    """Before reading a hub name: when the Hub cannot be reached, switch this process to offline mode, so
    that a cached copy loads at once and a missing one fails at once, instead of after minutes of retries
    with backoff. True when it did."""
    from huggingface_hub import constants

    if looks_local(name) or constants.HF_HUB_OFFLINE or hub_reachable():
        return False
    constants.HF_HUB_OFFLINE = True  # what huggingface_hub and transformers read
    os.environ["HF_HUB_OFFLINE"] = "1"  # and the processes this one starts
    return True


def load_or_explain(key: str, name: str, load: Callable[[], T]) -> T:
    """``load()``, with a missing checkpoint reported as ``not_found`` (at once when the Hub is offline)."""
    offline = offline_unless_reachable(name)
    try:
        return load()
    except OSError as error:
        offline_error = OSError("the Hub cannot be reached from here and no cached copy was found")
        raise not_found(key, name, offline_error if offline else error) from None
