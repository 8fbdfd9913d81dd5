"""The resolved config as the run saw it, with where every value came from, and secrets kept out.

``write_resolved_config`` writes ``<output_dir>/resolved-config.yaml`` at the start of a run: every key with its
value and a comment naming its origin (``run.yaml:12``, ``command line``, ``default``, or ``derived``).
``redact`` replaces secrets (tokens, keys, passwords, credentials in URLs) wherever a config is printed or
written, including ``posttrain validate`` and what trackers receive.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from posttrain.utils.fs import atomic_write_text

SECRET_KEY = re.compile(
    r"(^|[_-])(api[_-]?key|token|password|passwd|secret|credentials?|access[_-]?key|private[_-]?key)$",
    re.IGNORECASE,
)
URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^/@:\s]+):(?P<password>[^/@\s]+)@")
HIDDEN = "***"


def redact(value: Any, key: str = "") -> Any:
    """A copy with secret-looking keys' values and URL passwords replaced by ``***``."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str):
        if key and SECRET_KEY.search(key) and value:
            return HIDDEN
        return URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{HIDDEN}@", value)
    if key and SECRET_KEY.search(key) and value not in (None, False, True):
        return HIDDEN
    return value


def origin_of(
    loc: tuple[Any, ...], origins: dict[tuple[Any, ...], str], derived: set[tuple[Any, ...]]
) -> str:
    if loc in derived:
        return "derived"
    return origins.get(loc, "default")


def _scalar(value: Any) -> str:
    """A YAML scalar on one line (strings quoted only when YAML needs it)."""
    if not isinstance(value, str):
        return json.dumps(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def _lines(value: Any, loc: tuple[Any, ...], indent: str, origins: dict, derived: set) -> list[str]:
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        here = (*loc, key)
        label = f"{indent}{key}:" if isinstance(value, dict) else f"{indent}-"
        nested = (isinstance(item, dict) and bool(item)) or (
            isinstance(item, list) and any(isinstance(x, dict) for x in item)
        )
        if nested:
            out.append(label)
            out += _lines(item, here, indent + "  ", origins, derived)
        else:
            text = json.dumps(item) if isinstance(item, list | dict) else _scalar(item)
            out.append(f"{label} {text}  # {origin_of(here, origins, derived)}")
    return out


def resolved_config_text(config: Any, world_size: int) -> str:
    """YAML of the config (secrets redacted) with each value's origin as a comment."""
    data = redact(config.model_dump(mode="json"))
    origins = getattr(config, "_origins", {}) or {}
    derived = getattr(config, "_derived", set()) or set()
    header = [
        "# The fully resolved config of this run (posttrain writes it at the start; secrets are redacted).",
        f"# Origins: a file and line, 'command line', 'default', or 'derived'. World size: {world_size}.",
    ]
    return "\n".join([*header, *_lines(data, (), "", origins, derived)]) + "\n"


def write_resolved_config(config: Any, output_dir: Path, world_size: int) -> Path:
    path = output_dir / "resolved-config.yaml"
    atomic_write_text(path, resolved_config_text(config, world_size))
    return path
