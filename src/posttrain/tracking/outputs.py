"""Where each metrics record goes: the metrics file, the trackers, and the console (a progress bar on a
terminal, plain lines otherwise). Only rank 0 writes; every rank calls the same methods."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from posttrain.logs import say
from posttrain.tracking.metrics import JUDGED_BY, MetricsFile, format_line
from posttrain.tracking.trackers import Tracker


class ProgressBar:
    """A rich progress bar: step/total, loss, LR, tokens/s and ETA."""

    def __init__(self, total: int, done: int = 0, console: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, stats="")
        self.stats: dict[str, str] = {}
        self.progress.start()

    def update(self, record: dict[str, Any]) -> None:
        """Show the newest value of each field (an evaluation adds its loss to the last step's)."""
        judged = tuple((key, key + " {:.4f}") for key in JUDGED_BY)
        for key, fmt in (
            ("loss", "loss {:.4f}"),
            ("eval_loss", "eval_loss {:.4f}"),
            *judged,
            ("lr", "lr {:.2e}"),
        ):
            if record.get(key) is not None:
                self.stats[key] = fmt.format(record[key])
        if record.get("tokens_per_second") is not None:
            self.stats["speed"] = f"{record['tokens_per_second']:.0f} tok/s"
        order = ("loss", "eval_loss", *JUDGED_BY, "lr", "speed")
        stats = " | ".join(self.stats[k] for k in order if k in self.stats)
        if "loss" in record:
            self.progress.update(self.task, completed=record["iter"], stats=stats)
        else:
            self.progress.update(self.task, stats=stats)

    def close(self) -> None:
        self.progress.stop()


class RunOutputs:
    """Fan-out of metrics records. ``step`` records are training steps; ``eval`` records evaluations."""

    def __init__(
        self,
        metrics: MetricsFile,
        trackers: list[Tracker],
        total_steps: int,
        progress: ProgressBar | None = None,
    ) -> None:
        self.metrics, self.trackers, self.total_steps, self.progress = (
            metrics,
            trackers,
            total_steps,
            progress,
        )
        self._first: tuple[int, float] | None = None  # this run's first step record: (iter, time)

    def eta(self, record: dict[str, Any]) -> float | None:
        """Seconds left at this run's mean pace since its first step (plain lines; the bar has its own)."""
        if "loss" not in record or "time" not in record:
            return None
        if self._first is None:
            self._first = (int(record["iter"]), float(record["time"]))
            return None
        done = int(record["iter"]) - self._first[0]
        if done <= 0:
            return None
        return (
            (float(record["time"]) - self._first[1]) / done * max(self.total_steps - int(record["iter"]), 0)
        )

    def write(self, record: dict[str, Any], show: bool) -> None:
        self.metrics.write(record)
        for tracker in self.trackers:
            tracker.log(record, step=int(record["iter"]))
        eta = self.eta(record)
        if self.progress is not None:
            self.progress.update(record)
            if "loss" not in record:  # evaluations also get a line above the bar
                say(format_line(record, self.total_steps))
        elif show:
            say(format_line(record, self.total_steps, eta))

    def close(self, artifacts: list[Path] | None = None) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        for tracker in self.trackers:
            tracker.finish(artifacts or [])
        self.trackers = []
        self.metrics.close()


def wants_progress_bar(enabled: bool, is_main: bool) -> bool:
    return enabled and is_main and sys.stdout.isatty()
