"""Checkpoint engine ``huggingface``: exports safetensors + config + tokenizer (a vision-language model's
processor) that transformers loads."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.checkpoint.base import CheckpointEngine
from posttrain.checkpoint.model_card import base_model_place, model_card
from posttrain.config.checkpoint import HFCheckpointConfig
from posttrain.models.expert_parallel import full_experts
from posttrain.models.peft import base_model, is_peft_model
from posttrain.utils.fs import atomic_dir
from posttrain.vision.processor import processor_of


@contextmanager
def full_parameters(model: Any) -> Iterator[None]:
    """Under ZeRO-3, gather every parameter onto every rank for the duration (a collective: all ranks enter)."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def keep_used_conversions(model: Any) -> None:
    """Keep, of the checkpoint renamings transformers recorded when it loaded the model, only those it used.
    ``save_pretrained`` writes the checkpoint's own names back by reversing every recorded renaming; its
    ZeRO-3 loader (transformers 5.24) records every renaming it knows for the architecture, used or not, where
    its other loader keeps the used ones, so a ZeRO-3 run's export of Gemma 3 came out as
    ``language_model.model.model.*`` while a ZeRO-0 run's kept the checkpoint's names."""
    base = base_model(model)
    if getattr(base, "_weight_conversions", None):
        base._weight_conversions = used_conversions(model)


def used_conversions(model: Any) -> list[Any]:
    """The checkpoint renamings and converters transformers recorded when it loaded ``model`` and used."""
    conversions = getattr(base_model(model), "_weight_conversions", None) or []
    return [c for c in conversions if not hasattr(c, "was_used") or c.was_used()]


def checkpoint_names(model: Any, names: Iterable[str]) -> dict[str, str]:
    """The name each of ``names`` (the model's weights, PEFT's prefixes removed) has in the checkpoint the model
    was loaded from, as ``save_pretrained`` writes it: transformers' renamings used at load time, reversed (a
    LLaVA checkpoint in the hub's layout says ``vision_tower.vision_model.*`` where transformers 5 holds
    ``model.vision_tower.*``), in transformers' own order (sorted). A model loaded without renamings, or with
    weights a converter made (experts fused at load time: not reversed here), keeps the names it holds."""
    names = list(names)
    used = used_conversions(model)
    try:
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            apply_renamings,
            dot_natural_key,
        )

        reversed_ = [conversion.reverse_transform() for conversion in used[::-1]]
    except (ImportError, ValueError):  # another transformers; a quantized load's transforms do not reverse
        return {name: name for name in names}
    renamings = [r for r in reversed_ if isinstance(r, WeightRenaming)]
    if not renamings or any(isinstance(r, WeightConverter) for r in reversed_):
        return {name: name for name in names}
    return {name: apply_renamings(name, renamings) for name in sorted(names, key=dot_natural_key)}


class HFCheckpointEngine(CheckpointEngine):
    config: HFCheckpointConfig

    """Writes ``<output_dir>/global_step_<N>`` periodically and ``<output_dir>/<save_name or final>`` at
    the end; a run stopped before its planned end (kill switch, signal, ``exit_*``) names its last export
    ``global_step_<N>`` too, so ``final`` is always the finished run. Each export is written to a temporary
    directory and renamed into place by rank 0, with a ``README.md`` model card; an adapter records its base
    model as an absolute path (or the hub name). Under ZeRO-3 the full weights are gathered first, and with
    expert parallelism every layer's experts. Every rank calls ``save`` (the gathers are collective)."""

    def save(self, engine: Any, state: Any, *, end: bool = False) -> Path:
        model = engine.module
        finished = end and not state.stop_reason
        name = (self.ctx.config.model.save_name or "final") if finished else f"global_step_{state.step}"
        target = self.output_dir / name
        if not end and state.step == self.last_saved_step:
            return target  # saved already at this step (a step and an epoch interval can coincide)
        with full_parameters(model), full_experts(model):
            if self.ctx.dist.is_main:
                adapter = is_peft_model(model)
                self._write(model, target, model_card(self.ctx.config, state, adapter=adapter))
                if self.config.save_merged and adapter:
                    card = model_card(self.ctx.config, state, adapter=False, merged=True)
                    merged = copy.deepcopy(model).merge_and_unload()
                    self._write(merged, target.with_name(target.name + "-merged"), card)
        if not end:
            self.last_saved_step = state.step
        return target

    def _write(self, model: Any, target: Path, card: str) -> None:
        for adapter in getattr(model, "peft_config", {}).values():  # a PEFT model writes its adapter only
            adapter.base_model_name_or_path = base_model_place(adapter.base_model_name_or_path or "")
        keep_used_conversions(model)
        with atomic_dir(target) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            if self.tokenizer is not None:  # a vision-language model's processor, its tokenizer included
                (processor_of(self.tokenizer) or self.tokenizer).save_pretrained(tmp)
            (tmp / "README.md").write_text(card)
