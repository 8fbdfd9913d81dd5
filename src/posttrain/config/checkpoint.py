"""``checkpoint:`` — one entry per checkpoint engine; several engines can run together."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from pydantic import Field

from posttrain.config.base import BaseConfig, ModeKeys, Problem, uses_adapters
from posttrain.config.human import HumanInt, StepInterval


class CheckpointConfig(BaseConfig):
    type: str = ""
    """Checkpoint engine type. Defaults to the trainer's first accepted engine (``huggingface``)."""

    output_dir: str
    """Directory the checkpoints are written to (created in the run if missing)."""

    enabled: bool = True
    """Turn this engine on or off without removing its block."""

    auto_resume: bool = False
    """Resume from the newest complete checkpoint in ``output_dir`` if there is one."""

    save_every_n_steps: StepInterval = Field(default=0, ge=0)
    """Save every N optimizer steps (0: never). A fraction below 1 is a share of the run's steps (0.1: every
    10% of them, rounded up), as Hugging Face reads ``save_steps``."""

    save_every_n_epochs: HumanInt = Field(default=0, ge=0)
    """Save at the end of every N-th epoch (0: never)."""

    save_end_of_training: bool = False
    """Save once more when training ends (also after an early exit such as the kill switch)."""


class HFCheckpointConfig(CheckpointConfig):
    """Exports in Hugging Face format (safetensors + config + tokenizer); not resumable training state.
    With PEFT the export is the adapter in PEFT's format."""

    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(("save_merged",), uses_adapters, "LoRA adapters to merge (model.peft_config)"),
    )

    save_merged: bool = False
    """With PEFT, also write the base model with the adapter merged in, to ``<name>-merged``."""

    def problems(self) -> Iterator[Problem]:
        if self.auto_resume:
            yield Problem(
                "auto_resume",
                "the huggingface engine writes exports, not resumable training state; "
                "add a checkpoint with type: deepspeed to resume",
            )


class DeepSpeedCheckpointConfig(CheckpointConfig):
    """Full training state (model, optimizer, scheduler, RNG, data position) for exact resume."""

    save_total_limit: HumanInt = Field(default=0, ge=0)
    """Keep at most this many checkpoints, removing the oldest first (0: keep all)."""

    accept_batch_change: bool = False
    """Resuming on another number of processes whose global batch differs from the checkpoint's: continue from
    the same sample of the epoch with the new batch (the steps from there are not the original run's).
    Without it such a resume stops and says what would change; ``total_train_batch_size`` keeps the batch."""
