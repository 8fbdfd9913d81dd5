"""Rank-aware logging set up from ``logger:`` (which ranks print, which write files, the level)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from posttrain.config.logger import LoggerConfig

LOGGER_NAME = "posttrain"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a line is emitted, so lines land above a progress bar that
    redirects standard output while it is shown."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def _selected(ranks: str | list[int], rank: int) -> bool:
    return ranks == "*" or rank in ranks


def setup_logging(config: LoggerConfig, rank: int) -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    fmt = logging.Formatter(f"[%(asctime)s] [rank {rank}] %(message)s", "%H:%M:%S")
    if _selected(config.print_output_ranks, rank):
        stream = _StdoutHandler()
        stream.setFormatter(fmt)
        stream.setLevel(logging.INFO)  # progress and metrics are INFO; `level` gates the rest, see below
        stream.addFilter(
            lambda record: (
                record.levelno >= logging.getLevelName(config.level) or getattr(record, "always", False)
            )
        )
        logger.addHandler(stream)
    if _selected(config.file_output_ranks, rank):
        path = Path(config.output_dir) / "logs" / f"rank-{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
        handler.setFormatter(fmt)
        handler.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def say(message: str) -> None:
    """A line the user should always see (progress, metrics, summaries) on the printing ranks."""
    get_logger().info(message, extra={"always": True})
