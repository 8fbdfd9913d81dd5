"""What every component builder receives: the validated config and this process's place in the run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from posttrain.config.trainer import TrainerConfig
from posttrain.dist import DistInfo


@dataclass
class RunContext:
    config: TrainerConfig
    dist: DistInfo

    @property
    def output_dir(self) -> Path:
        return Path(self.config.logger.output_dir)
