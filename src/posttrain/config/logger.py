"""``logger:`` — where log lines go."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from posttrain.config.base import BaseConfig

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class LoggerConfig(BaseConfig):
    output_dir: str = ""
    """The run's output directory: log files, the metrics file, the kill switch and profiles live here.
    Empty: ``runs/<config file name>`` under the current directory (ArcticTraining's ``/dev/null`` would send
    everything nowhere and make every job share the same kill switch)."""

    level: str = "WARNING"
    """Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL. Progress and metric lines print at every level."""

    print_output_ranks: Literal["*"] | list[int] = [0]
    """Ranks whose log lines are printed: a list of ranks or ``"*"`` for all."""

    file_output_ranks: Literal["*"] | list[int] = "*"
    """Ranks that write a log file (``<output_dir>/logs/rank-N.log``): a list of ranks or ``"*"``."""

    progress_bar: bool = True
    """A progress bar (step/total, loss, LR, tokens/s, ETA) on rank 0 when standard output is a terminal;
    otherwise, or when false, a metrics line every ``loss_log_interval`` steps."""

    @field_validator("level", mode="before")
    @classmethod
    def _level(cls, value: object) -> object:
        if isinstance(value, str):
            if value.upper() not in LEVELS:
                raise ValueError(f"unknown log level {value!r}; allowed: {', '.join(LEVELS)}")
            return value.upper()
        return value
