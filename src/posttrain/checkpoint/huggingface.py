"""Checkpoint engine ``huggingface``: exports safetensors + config + tokenizer that transformers loads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.config.checkpoint import HFCheckpointConfig
from posttrain.context import RunContext
from posttrain.registry import CHECKPOINT_ENGINES
from posttrain.utils.fs import atomic_dir


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


@CHECKPOINT_ENGINES.register("huggingface", config=HFCheckpointConfig)
class HFCheckpointEngine:
    """Writes ``<output_dir>/global_step_<N>`` periodically and ``<output_dir>/<save_name or final>`` at
    the end. Each export is written to a temporary directory and renamed into place by rank 0; under ZeRO-3
    the full weights are gathered first. Every rank calls ``save`` (the gather is collective)."""

    def __init__(self, config: HFCheckpointConfig, ctx: RunContext, tokenizer: Any) -> None:
        self.config = config
        self.ctx = ctx
        self.tokenizer = tokenizer
        self.output_dir = Path(config.output_dir)

    def due(self, *, step: int, epoch_end: int | None = None, end: bool = False) -> bool:
        """Whether to save now: after ``step`` optimizer steps, at the end of epoch ``epoch_end`` (1-based),
        or at the end of training."""
        if not self.config.enabled:
            return False
        if end:
            return self.config.save_end_of_training
        if epoch_end is not None:
            n = self.config.save_every_n_epochs
            return n > 0 and epoch_end % n == 0
        n = self.config.save_every_n_steps
        return n > 0 and step % n == 0

    def save(self, model: Any, *, step: int, end: bool = False) -> Path:
        name = (self.ctx.config.model.save_name or "final") if end else f"global_step_{step}"
        target = self.output_dir / name
        with full_parameters(model):
            if self.ctx.dist.is_main:
                with atomic_dir(target) as tmp:
                    model.save_pretrained(tmp, safe_serialization=True)
                    if self.tokenizer is not None:
                        self.tokenizer.save_pretrained(tmp)
        return target
