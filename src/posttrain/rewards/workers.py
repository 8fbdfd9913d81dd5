"""Reward worker processes (``reward_num_workers``): a zygote imports and builds the rewards once, then forks a
worker per pipe; a worker that dies or runs past its time is killed and replaced, and a failed call is retried
one completion at a time (``one_by_one``) to find the completions it fails on. The parent keeps the time."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from posttrain.rewards.calls import LOCAL_ARGUMENTS, Outcome, RewardContext, call_here

# --------------------------------------------------------------------------------------------- workers


def _serve(connection: Any, rewards: list[Any]) -> None:
    """A worker (forked from the zygote, its rewards built): call them as asked until the pipe closes."""
    while True:
        try:
            index, arguments = connection.recv()
        except (EOFError, OSError):
            return
        context = RewardContext(trainer_state=arguments.get("trainer_state"))
        arguments.update(log_extra=context.log_extra, log_metric=context.log_metric)
        outcome = call_here(rewards[index].function, arguments, None)  # the parent keeps the time
        if outcome.values is not None:
            outcome.values = (
                [_plain(v) for v in outcome.values] if _listlike(outcome.values) else outcome.values
            )
        outcome.extra, outcome.logged = context.take()
        try:
            connection.send(outcome)
        except Exception as exc:  # a value that does not pickle
            connection.send(Outcome(failure="error", text=f"its values could not be sent back: {exc}"))


def _zygote(control: Any, configs: list[Any], max_completion_length: int, build: Any) -> None:
    """The process workers are forked from: it imports and builds the rewards once (spawned: no CUDA or
    thread state of the trainer), then forks a worker for every pipe the trainer sends it, answering with the
    worker's PID, and tells how a worker ended when asked (``("status", pid)``). A worker therefore starts in
    milliseconds, however long the imports take."""
    import os

    # SIGTERM/SIGINT are the training process's: a group signal (timeout, Ctrl-C) or SLURM's to every process
    # would kill a worker mid-call and fail the step the stop is finishing; the trainer ends them at its exit
    # (and a worker ends when its pipe closes). The workers forked from here inherit this.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import transformers.trainer_callback  # noqa: F401  (the calls' trainer_state unpickles without an import)

    rewards = build(configs, max_completion_length)
    ended: dict[int, str] = {}

    def reap(signum: int, frame: Any) -> None:
        with contextlib.suppress(ChildProcessError):
            while (found := os.waitpid(-1, os.WNOHANG))[0]:
                pid, status = found
                code = os.waitstatus_to_exitcode(status)
                ended[pid] = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    signal.signal(signal.SIGCHLD, reap)
    control.send("ready")
    while True:
        try:
            message = control.recv()
        except (EOFError, OSError):
            return
        if isinstance(message, tuple):  # ("status", pid): how that worker ended
            pid = message[1]
            for _ in range(100):
                if pid in ended:
                    break
                reap(0, None)
                time.sleep(0.01)
            control.send(ended.pop(pid, "still running"))
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _serve(message, rewards)
            os._exit(0)
        message.close()
        control.send(pid)


def _listlike(values: Any) -> bool:
    return (
        hasattr(values, "__len__")
        and hasattr(values, "__getitem__")
        and not isinstance(values, str | bytes | dict)
    )


def _plain(value: Any) -> Any:
    if hasattr(value, "ndim") and getattr(value, "ndim", 1) == 0 and hasattr(value, "item"):
        return value.item()
    return value


@dataclass
class _Worker:
    pid: int
    handle: int  # a pidfd: the kill reaches this process, never one that took its PID later
    pipe: Any


class RewardWorkers:
    """Worker processes that hold the run's reward functions (``configs``, built once in a zygote process and
    forked from it) and score calls in parallel: ``count`` of them, more for a call's one-by-one retries
    (up to ``RETRY_WIDTH`` at once, so completions that hang cost about one ``timeout`` together, not one
    each). A worker that runs past ``timeout`` or dies is killed and replaced by a fresh fork at once."""

    RETRY_WIDTH = 32

    def __init__(
        self, count: int, configs: list[Any], max_completion_length: int, timeout: float | None, build: Any
    ) -> None:
        self.count, self.configs, self.limit, self.timeout = count, configs, max_completion_length, timeout
        self.build = build
        self.context = multiprocessing.get_context("spawn")
        self.zygote: tuple[Any, Any] | None = None
        self.workers: list[_Worker] = []
        self.replaced = 0

    def _start_zygote(self) -> None:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(
            target=_zygote,
            args=(theirs, self.configs, self.limit, self.build),
            daemon=True,
            name="posttrain-rewards",
        )
        process.start()
        theirs.close()
        if not ours.poll(300) or ours.recv() != "ready":
            raise RuntimeError(f"the reward workers' process did not start (exit code {process.exitcode})")
        self.zygote = (process, ours)

    def _fork(self) -> _Worker:
        import os

        if self.zygote is None or not self.zygote[0].is_alive():
            self._start_zygote()
        assert self.zygote is not None
        ours, theirs = self.context.Pipe()
        self.zygote[1].send(theirs)
        theirs.close()
        pid = self.zygote[1].recv()
        return _Worker(pid, os.pidfd_open(pid), ours)

    def _kill(self, worker: _Worker) -> None:
        import os

        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(worker.handle, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(worker.handle)
        worker.pipe.close()

    def run(
        self, tasks: Sequence[tuple[int, dict[str, Any]]], width: int | None = None, keep: bool = False
    ) -> list[Outcome]:
        """The outcome of every ``(reward index, arguments)`` call, in order, ``width`` at a time (default
        ``count``; the workers past ``count`` end with the call, unless ``keep``: every call is that wide)."""
        import time

        width = max(1, min(width or self.count, len(tasks) or 1))
        while len(self.workers) < width:
            self.workers.append(self._fork())
        outcomes: list[Outcome | None] = [None] * len(tasks)
        queue = list(range(len(tasks)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (task, deadline)
        while queue or busy:
            for slot in range(width):
                if slot not in busy and queue:
                    task = queue.pop()
                    index, arguments = tasks[task]
                    sent = {k: v for k, v in arguments.items() if k not in LOCAL_ARGUMENTS}
                    self.workers[slot].pipe.send((index, sent))
                    busy[slot] = (task, time.monotonic() + (self.timeout or float("inf")))
            pipes = {self.workers[s].pipe: s for s in busy}
            nearest = min(deadline for _, deadline in busy.values())
            ready = wait(list(pipes), timeout=max(0.0, min(nearest - time.monotonic(), 3600.0)))
            for pipe in ready:
                slot = pipes[pipe]  # type: ignore[index]
                task, _ = busy.pop(slot)
                try:
                    outcomes[task] = pipe.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    outcomes[task] = Outcome(
                        failure="died", text=f"its worker process died ({self._ended(slot)})"
                    )
                    self._replace(slot)
            now = time.monotonic()
            for slot, (task, deadline) in list(busy.items()):
                if now >= deadline:
                    busy.pop(slot)
                    outcomes[task] = Outcome(
                        failure="timeout", text=f"took more than {self.timeout:g} s (reward_timeout)"
                    )
                    self._replace(slot)
        while len(self.workers) > self.count and not keep:  # the retries' extra workers
            self._kill(self.workers.pop())
        return [o for o in outcomes if o is not None]

    def _ended(self, slot: int) -> str:
        """How a worker that closed its pipe ended (the zygote, its parent, read the kernel's record)."""
        assert self.zygote is not None
        try:
            self.zygote[1].send(("status", self.workers[slot].pid))
            return str(self.zygote[1].recv())
        except (EOFError, OSError):
            return "exit code unknown"

    def _replace(self, slot: int) -> None:
        self._kill(self.workers[slot])
        self.workers[slot] = self._fork()
        self.replaced += 1

    def close(self) -> None:
        for worker in self.workers:
            self._kill(worker)
        self.workers = []
        if self.zygote is not None:
            process, pipe = self.zygote
            pipe.close()
            process.kill()
            process.join(5)
            self.zygote = None


def one_by_one(arguments: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The arguments of each completion alone: every per-completion list cut to its item."""
    out = []
    for index in range(count):
        single = {}
        for key, value in arguments.items():
            single[key] = [value[index]] if isinstance(value, list) and len(value) == count else value
        out.append(single)
    return out
