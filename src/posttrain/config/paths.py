"""What ``posttrain validate`` says about the local files a valid config names but that are not there.

Validation itself reads no file (it is pure); this looks, after it, at the local inputs the run will open:
data files, Megatron prefixes, local model and tokenizer directories, a chat template file. Hub names
(``org/name``) are left to the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttrain.config.data import LocalSourceConfig, MegatronSourceConfig
from posttrain.utils.hub import looks_local


def missing_inputs(config: Any) -> Iterator[str]:
    """``key: path: what is missing`` for every named local input that does not exist."""
    for key in ("sources", "eval_sources"):
        for index, source in enumerate(getattr(config.data, key)):
            where, path = f"data.{key}[{index}]", source.name_or_path
            if isinstance(source, LocalSourceConfig) and not Path(path).expanduser().is_file():
                yield f"{where}: {path}: no such file"
            elif isinstance(source, MegatronSourceConfig):
                for suffix in (".bin", ".idx"):
                    if not Path(path + suffix).expanduser().is_file():
                        yield f"{where}: {path}{suffix}: no such file (a Megatron prefix names PREFIX.bin and PREFIX.idx)"
    named = {"model": config.model.name_or_path}
    if config.tokenizer.name_or_path not in ("", None, config.model.name_or_path):
        named["tokenizer"] = config.tokenizer.name_or_path
    for key, name in named.items():
        if looks_local(name) and not Path(name).expanduser().is_dir():
            yield f"{key}.name_or_path: {name}: no such directory (and not a hub name org/name)"
    template = config.tokenizer.chat_template
    if template.endswith((".jinja", ".j2")) and not Path(template).expanduser().is_file():
        yield f"tokenizer.chat_template: {template}: no such file"
