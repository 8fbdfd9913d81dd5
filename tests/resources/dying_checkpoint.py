"""User code for resume tests: a deepspeed checkpoint engine that kills its own process with SIGKILL,
either right after the checkpoint of ``die_at_step`` is complete or in the middle of writing it."""

import os
import signal

from posttrain.checkpoint.deepspeed import DeepSpeedCheckpointEngine
from posttrain.config.checkpoint import DeepSpeedCheckpointConfig
from posttrain.registry import CHECKPOINT_ENGINES


class DyingConfig(DeepSpeedCheckpointConfig):
    die_at_step: int = 0
    """Step whose save kills the process."""

    die_during_save: bool = False
    """Die after the shards are written but before the checkpoint is committed."""


@CHECKPOINT_ENGINES.register("deepspeed-dies", config=DyingConfig)
class DyingEngine(DeepSpeedCheckpointEngine):
    def _commit(self, written, target, record):
        if self.config.die_during_save and record["step"] == self.config.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._commit(written, target, record)

    def save(self, engine, state, *, end=False):
        path = super().save(engine, state, end=end)
        if not self.config.die_during_save and state.step == self.config.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return path
