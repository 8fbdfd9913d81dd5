"""An export as transformers and PEFT load it: a full model directory or an adapter (with its base), and the
tokenizer saved beside it. Anything missing is one clean line, never a traceback."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.utils.hub import load_or_explain
from posttrain.vision.processor import attach, auto_model_class, is_vision_language


@dataclass
class Export:
    model: Any  # a transformers model (an adapter's PeftModel, when not merged)
    tokenizer: Any
    adapter: bool
    base: str  # the base model's place for an adapter, else the export itself


def is_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def export_parts(path: Path) -> tuple[bool, str]:
    """Whether ``path`` is an adapter, and the base model it applies to (``path`` itself for a full model);
    a directory that is neither is one clean line."""
    if not path.is_dir():
        raise UserError(f"{path}: no such export directory (a posttrain export: <output_dir>/final)")
    if not (path / "config.json").is_file() and not is_adapter(path):
        raise UserError(
            f"{path}: neither a model (config.json) nor an adapter (adapter_config.json); "
            "point at an export directory such as <checkpoint output_dir>/final"
        )
    if not is_adapter(path):
        return False, str(path)
    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if not base:
        raise UserError(f"{path}/adapter_config.json names no base_model_name_or_path")
    return True, base


def load_export(path: Path, *, device: str | None = None, merge: bool = False) -> Export:
    """The model and tokenizer of ``path`` (``dtype="auto"``: as saved), on ``device`` (a GPU when there
    is one), in eval mode; an adapter is applied to its base, and merged into it with ``merge``."""
    import torch

    adapter, base = export_parts(path)
    if adapter:
        from peft import PeftModel
        from transformers import AutoConfig

        loaded = load_or_explain(
            "the adapter's base_model_name_or_path",
            base,
            lambda: auto_model_class(AutoConfig.from_pretrained(base)).from_pretrained(base, dtype="auto"),
        )
        with warnings.catch_warnings():  # PEFT calls a transformers API deprecated for v6
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(loaded, path)
        if merge:
            model = model.merge_and_unload()
    else:
        from transformers import AutoConfig

        model = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype="auto")
    tokenizer = _tokenizer(path, base, is_vision_language(model.config))
    model = model.to(torch.device(_device(device))).eval()
    return Export(model, tokenizer, adapter and not merge, base)


def _tokenizer(path: Path, base: str, reads_images: bool) -> Any:
    """The export's tokenizer (posttrain saves it with every export), else the base model's."""
    from transformers import AutoTokenizer

    source = str(path) if (path / "tokenizer_config.json").is_file() else base
    if reads_images:  # a vision-language model: its processor, carried by its tokenizer
        from transformers import AutoProcessor

        processor = load_or_explain("processor", source, lambda: AutoProcessor.from_pretrained(source))
        return attach(processor.tokenizer, processor)
    return load_or_explain("tokenizer", source, lambda: AutoTokenizer.from_pretrained(source))
