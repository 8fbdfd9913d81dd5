"""``wandb:`` — Weights & Biases tracking."""

from __future__ import annotations

from collections.abc import Iterator

from posttrain.config.base import BaseConfig, Problem, unsupported


class WandBConfig(BaseConfig):
    enable: bool = False
    """Log metrics to Weights & Biases. Not supported yet."""

    entity: str | None = None
    """W&B entity (user or team)."""

    project: str | None = "posttrain"
    """W&B project (the seed's default is ``arctic-training``)."""

    name: str | None = None
    """W&B run name."""

    def problems(self) -> Iterator[Problem]:
        yield from unsupported("enable", self.enable, False, "trackers arrive with issue #6")
