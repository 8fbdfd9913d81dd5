"""One reward call: what a function gets besides the data (``RewardContext``, TRL's extra arguments), its
``Outcome`` (values, or a failure with the place in the user's code), and a call in this process within a time
limit (``call_here``): a ``SIGALRM`` timer, which stops Python code (a loop, a ``sleep``) but not a C call that
ignores signals, and ``asyncio.wait_for`` for an ``async`` reward. Calls in worker processes are
``reward_workers``'; how a run's calls are made and checked, ``reward_guard``'s."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import threading
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import UserError

#: what TRL hands a reward function besides the data, by its names
CONTEXT_KEYS = ("trainer_state", "log_extra", "log_metric")
#: the arguments a worker cannot receive (callables of this process, environment instances)
LOCAL_ARGUMENTS = ("log_extra", "log_metric", "environments")


class RewardTimeout(Exception):
    pass


class RewardError(UserError):
    """A reward function failed on real data: which function, where, on which row."""


@dataclass
class RewardContext:
    """What a reward function gets besides the data, as TRL gives it: ``trainer_state`` (a transformers
    ``TrainerState``: ``global_step``, ``max_steps``, ``epoch``... for rewards shaped by progress),
    ``log_extra(column, values)`` (a column of the completions log, one value per completion of the call) and
    ``log_metric(name, value)`` (a scalar, averaged over the batch's calls on every rank into the step's
    record)."""

    trainer_state: Any = None
    extra: dict[str, list[Any]] = field(default_factory=dict)
    logged: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        self.extra.setdefault(str(column), []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.logged.setdefault(str(name), []).append(float(value))

    def arguments(self) -> dict[str, Any]:
        return {
            "trainer_state": self.trainer_state,
            "log_extra": self.log_extra,
            "log_metric": self.log_metric,
        }

    def take(self) -> tuple[dict[str, list[Any]], dict[str, list[float]]]:
        """What the functions logged since the last call, and forget it."""
        extra, logged = self.extra, self.logged
        self.extra, self.logged = {}, {}
        return extra, logged


@dataclass
class Outcome:
    """One reward call's result: ``values``, or ``failure`` (``timeout``, ``error``, ``died``: its worker
    process ended) with its text and the place in the user's code (``file:line``)."""

    values: Any = None
    failure: str | None = None
    text: str = ""
    at: str = ""
    extra: dict[str, list[Any]] | None = None
    logged: dict[str, list[float]] | None = None


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`RewardTimeout` in this (main) thread after ``seconds``; nothing elsewhere or unlimited."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise RewardTimeout()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def user_frame(exc: BaseException) -> str:
    """``file:line`` of the deepest frame outside posttrain's reward calling and asyncio."""
    import os

    ours = (os.path.dirname(__file__), os.path.dirname(asyncio.__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(ours)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def call_here(
    function: Any, arguments: dict[str, Any], timeout: float | None, defer: bool = False
) -> Outcome:
    """Call a reward in this process within ``timeout`` seconds; an ``async`` one is awaited (``defer``: its
    awaitable is the outcome's values, for the caller to gather with others)."""
    try:
        with time_limit(timeout):
            result = function(**arguments)
            if inspect.isawaitable(result) and not defer:
                result = asyncio.run(bounded(result, timeout))
        return Outcome(values=result)
    except (RewardTimeout, TimeoutError):
        return Outcome(failure="timeout", text=f"took more than {timeout:g} s (reward_timeout)")
    except Exception as exc:
        if isinstance(exc, RewardError):
            raise
        return Outcome(failure="error", text=f"{type(exc).__name__}: {exc}", at=user_frame(exc))


async def bounded(awaitable: Any, timeout: float | None) -> Any:
    return await asyncio.wait_for(awaitable, timeout) if timeout else await awaitable
