"""``wandb:`` — Weights & Biases tracking."""

from __future__ import annotations

from typing import ClassVar, Literal

from posttrain.config.base import BaseConfig, ModeKeys


class WandBConfig(BaseConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(("entity", "project", "name", "mode"), lambda c, root: c.enable, "wandb.enable: true"),
    )
    enable: bool = False
    """Log metrics to Weights & Biases (rank 0). The run id is saved in resumable checkpoints, so a resumed
    run continues the same W&B run."""

    entity: str | None = None
    """W&B entity (user or team)."""

    project: str | None = "posttrain"
    """W&B project (ArcticTraining's default is ``arctic-training``)."""

    name: str | None = None
    """W&B run name."""

    mode: Literal["online", "offline"] = "online"
    """``offline`` writes the run under ``<logger.output_dir>/wandb`` for a later ``wandb sync`` (no network).
    The API key comes from the environment (``WANDB_API_KEY``) or ``wandb login``, never from the config."""
