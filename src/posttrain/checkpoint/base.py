"""What every checkpoint engine shares: when to save."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from posttrain.config.checkpoint import CheckpointConfig
from posttrain.context import RunContext


class CheckpointEngine(ABC):
    #: whether a stop before the planned end (signal, kill switch, time limit) always saves
    saves_on_early_stop = False

    def __init__(self, config: CheckpointConfig, ctx: RunContext, tokenizer: Any) -> None:
        self.config = config
        self.ctx = ctx
        self.tokenizer = tokenizer
        self.output_dir = Path(config.output_dir)
        self.last_saved_step: int | None = None

    def due(self, *, step: int, epoch_end: int | None = None, end: bool = False, early: bool = False) -> bool:
        """Whether to save now: after ``step`` optimizer steps, at the end of epoch ``epoch_end`` (1-based),
        or at the end of training (``early``: the run was stopped before its planned end)."""
        if not self.config.enabled:
            return False
        if end:
            return self.config.save_end_of_training or (early and self.saves_on_early_stop)
        if epoch_end is not None:
            n = self.config.save_every_n_epochs
            return n > 0 and epoch_end % n == 0
        n = self.config.save_every_n_steps
        return n > 0 and step % n == 0

    @abstractmethod
    def save(self, engine: Any, state: Any, *, end: bool = False) -> Path:
        """Write a checkpoint; called on every rank."""

    def load(self, engine: Any, state: Any) -> Path | None:
        """Restore from the newest complete checkpoint if this engine resumes (``auto_resume``)."""
        return None
