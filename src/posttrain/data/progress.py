"""Progress of a data build on the main process: a rich bar (rows/s, ETA) on a terminal, else a plain line
at every 10%. Builds of fewer than ``MIN_ROWS`` rows take a moment and show nothing."""

from __future__ import annotations

import sys
import time
from typing import Any

from posttrain.logs import say

MIN_ROWS = 5000


class BuildProgress:
    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.started = time.perf_counter()
        self.enabled = enabled and total >= MIN_ROWS
        self.next_line = 0.1
        self.bar: Any = None
        if self.enabled and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]data"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[speed]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=True,
            )
            self.task = self.bar.add_task("data", total=self.total, speed="")
            self.bar.start()

    def _rate(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def advance(self, rows: int) -> None:
        if not self.enabled:
            return
        self.done += rows
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, speed=f"{self._rate():.0f} rows/s")
            return
        share = self.done / self.total
        if share >= self.next_line - 1e-9:
            rate = self._rate()
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            say(f"data: {self.done}/{self.total} rows ({share:.0%}), {rate:.0f} rows/s, ETA {eta:.0f} s")
            while self.next_line <= share + 1e-9:
                self.next_line += 0.1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
