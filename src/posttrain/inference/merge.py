"""``posttrain merge ADAPTER -o OUT``: an adapter export merged into its base model, saved as a standalone
model directory (weights, config, tokenizer, model card) that plain transformers loads."""

from __future__ import annotations

from pathlib import Path

from posttrain.checkpoint.model_card import merged_card
from posttrain.errors import UserError
from posttrain.inference.export import is_adapter, load_export
from posttrain.utils.fs import atomic_dir
from posttrain.vision.processor import processor_of


def merge_adapter(adapter: Path, out: Path) -> Path:
    if not is_adapter(adapter):
        raise UserError(
            f"{adapter}: no adapter_config.json; point at a LoRA (PEFT) export, e.g. <output_dir>/final "
            "of a run with model.peft_config"
        )
    if out.exists():
        raise UserError(f"{out} exists; choose another path with -o (nothing was changed)")
    export = load_export(adapter, device="cpu", merge=True)
    with atomic_dir(out) as tmp:
        export.model.save_pretrained(tmp, safe_serialization=True)
        (processor_of(export.tokenizer) or export.tokenizer).save_pretrained(tmp)  # a VLM's processor
        (tmp / "README.md").write_text(merged_card(export.base, adapter))
    return out
