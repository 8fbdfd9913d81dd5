"""Graceful stops: the kill switch file, SIGTERM/SIGINT, and a wall-clock limit.

Each rank checks its own conditions after every step; the loop sums the flags over ranks in the step's one
all-reduce, so every rank stops after the same step. The run then saves what it is configured to save
(a ``deepspeed`` checkpoint engine always saves a resumable checkpoint on such a stop) and exits with 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

#: set by ``--nproc`` for the ranks (``launch.py``): a directory where each rank notes how it ended, so that the
#: command's exit status is the run's, not the launcher's (a user error: 2; a graceful stop: 0)
LAUNCH_NOTES = "POSTTRAIN_USER_ERROR_DIR"


def note_stopped() -> None:
    """In a rank a launcher started: it stopped gracefully (a signal, the kill switch, the time limit) and
    saved; the launcher, which may itself have been signalled (SLURM signals every process), exits 0."""
    directory = os.environ.get(LAUNCH_NOTES)
    if directory and "RANK" in os.environ:
        with open(os.path.join(directory, f"stopped-rank-{os.environ['RANK']}"), "w") as note:
            note.write("stopped after saving\n")


def ignore_stop_signals(worker: int = 0) -> None:
    """A DataLoader worker's ``worker_init_fn``: SIGTERM and SIGINT are the training process's to handle.
    ``timeout``, SLURM and Ctrl-C signal the whole process group (SLURM every process of the job); a worker
    that died of the signal would fail the step the training process is finishing, before its stop-time
    checkpoint. The training process ends its workers when it exits."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def stop_during_set_up() -> Iterator[None]:
    """Around ``train``, until the loop's own handlers take over (:meth:`StopSignals.install`): a SIGTERM or
    SIGINT ends the command at once with one line (nothing is trained yet, and nothing half-written stays:
    every output is written aside and renamed) instead of killing it without a word. The handlers before are
    back after the block; a process forked meanwhile (a data worker) keeps the default action."""
    owner = os.getpid()

    def stop(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked child: the signal's default action, as before the fork
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        print(
            f"stopped by {name} during set-up, before the first step: nothing trained, nothing saved",
            flush=True,
        )
        raise SystemExit(128 + signum)

    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, stop)
    except ValueError:  # not the main thread (an in-process test run): the handlers stay as they are
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StopSignals:
    def __init__(
        self, exit_duration_in_mins: float | None = None, event: threading.Event | None = None
    ) -> None:
        self.started = time.monotonic()
        self.event = event or threading.Event()  # set when a signal comes (``RunContext.stopping``)
        self.limit_s = exit_duration_in_mins * 60 if exit_duration_in_mins else None
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Catch SIGTERM and SIGINT (main thread only); a second SIGINT interrupts at once."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test runners): no graceful signals
                return

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def check(self, kill_switch_path: str, step_time: float) -> list[float]:
        """This rank's flags: [kill switch present, signal received, time limit (before the next step ends)]."""
        out_of_time = self.limit_s is not None and time.monotonic() - self.started + step_time >= self.limit_s
        return [float(os.path.exists(kill_switch_path)), float(bool(self.signal_name)), float(out_of_time)]

    def reason(self, flags: list[float]) -> str:
        """Why to stop, from the flags summed over ranks (empty: go on)."""
        killed, signaled, timed = flags
        if signaled:
            return f"{self.signal_name or 'a signal'} received"
        if killed:
            return "kill switch found"
        if timed:
            return f"exit_duration_in_mins={self.limit_s / 60:g} reached"
        return ""
