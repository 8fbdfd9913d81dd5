"""What every component builder receives: the validated config and this process's place in the run."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.config.trainer import TrainerConfig
from posttrain.dist import DistInfo


@dataclass
class RunContext:
    config: TrainerConfig
    dist: DistInfo
    #: set as soon as this process is asked to stop (SIGTERM, SIGINT: ``training.stops``), mid-step too: a part
    #: that would wait for something the stop may have taken (a server that came down with the allocation) gives
    #: up instead of waiting, so the run saves after its last whole step
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def output_dir(self) -> Path:
        return Path(self.config.logger.output_dir)
