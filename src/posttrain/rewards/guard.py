"""How a run's reward functions are called: a time limit per call (``reward_timeout``), in worker processes
(``reward_num_workers``), what a failure does (``reward_errors``): ``raise`` stops the run naming the
function, its file and line and the rows; ``unscorable`` scores the call's completions one by one to find those
that fail, and marks them unscorable (every reward NaN: advantage 0, out of their group's statistics, as TRL
treats a completion no reward scored). Failures are counted per reward (``rewards/<name>/timeouts``,
``rewards/<name>/errors``: completions). Every value is checked as it returns: one number, bool or None per
completion, else the run stops naming the function, its line and the row. Environment rewards
(``get_reward``) run in this process, where the environments are; so does every reward when
``reward_num_workers`` is 0."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from posttrain.rewards.calls import (
    Outcome,
    RewardContext,
    RewardError,
    bounded,
    call_here,
    user_frame,
)
from posttrain.rewards.workers import RewardWorkers, one_by_one

if TYPE_CHECKING:
    from posttrain.rewards.functions import Reward


class RewardGuard:
    """How reward functions are called (``reward_guard``): the time limit, the worker processes, what a
    failure does, the failures counted per reward and the completions the last call left unscorable."""

    def __init__(
        self,
        timeout: float | None = None,
        errors: str = "raise",
        workers: RewardWorkers | None = None,
    ) -> None:
        self.timeout, self.errors, self.workers = timeout, errors, workers
        self.counts: dict[str, dict[str, int]] = {}
        self.unscorable: set[int] = set()

    def call(
        self,
        rewards: Sequence[Reward],
        calls: list[tuple[int, dict[str, Any]]],
        width: int | None = None,
        keep: bool = False,
    ) -> list[Outcome]:
        """The outcome of each ``(reward index, arguments)`` call: in the workers (``width`` at a time, the
        extra workers kept for the next call with ``keep``; but for rewards that must run here), else here,
        ``async`` ones awaited together as TRL gathers them."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        remote = [i for i, (r, _) in enumerate(calls) if self.workers is not None and not rewards[r].local]
        if remote:
            assert self.workers is not None
            found = self.workers.run([calls[i] for i in remote], width, keep)
            for i, outcome in zip(remote, found, strict=True):
                outcomes[i] = outcome
        pending: list[tuple[int, Any]] = []
        for i, (r, arguments) in enumerate(calls):
            if outcomes[i] is None:
                outcomes[i] = call_here(rewards[r].function, arguments, self.timeout, defer=True)
                if inspect.isawaitable(outcomes[i].values):  # type: ignore[union-attr]
                    pending.append((i, outcomes[i].values))  # type: ignore[union-attr]
        if pending:

            async def gather() -> list[Any]:
                limited = [bounded(value, self.timeout) for _, value in pending]
                return await asyncio.gather(*limited, return_exceptions=True)

            for (i, _), value in zip(pending, asyncio.run(gather()), strict=True):
                outcomes[i] = _awaited_outcome(value, self.timeout)
        return [o for o in outcomes if o is not None]

    def splits(self, reward: Reward) -> bool:
        """Whether ``reward`` is called once per completion from the start: under ``reward_errors: unscorable``
        with a time limit, in the workers. A hung completion then costs one ``reward_timeout`` (its call is cut
        while the others return), not the whole call's timeout and then another for the one-by-one retry; and
        a completion's value never depends on whether another one of its call hung."""
        return (
            self.errors == "unscorable"
            and self.timeout is not None
            and self.workers is not None
            and not reward.local
        )

    def count(self, name: str, kind: str) -> None:
        found = self.counts.setdefault(name, {"timeouts": 0, "errors": 0})
        found["timeouts" if kind == "timeout" else "errors"] += 1

    def take_counts(self) -> dict[str, dict[str, int]]:
        counts, self.counts = self.counts, {}
        return counts

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def score_all(
    rewards: Sequence[Reward],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    origins: list[str],
    context: RewardContext | None = None,
    guard: RewardGuard | None = None,
) -> list[list[float]]:
    """Every reward's values for the completions, each function called with TRL's arguments: the prompts,
    completions and their ids, every other column of the rows, and the ``context`` (``trainer_state``,
    ``log_extra``, ``log_metric``). ``guard`` (default: no time limit, in this process, failures raise) says
    how; under ``reward_errors: unscorable`` a failed call is made again per completion, and the completions
    that fail alone are left in ``guard.unscorable`` (their values NaN here)."""
    guard = guard or RewardGuard()
    context = context or RewardContext()
    arguments = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    arguments.update(context.arguments())
    guard.unscorable = set()
    count = len(completions)
    singles = one_by_one(arguments, count)
    calls: list[tuple[int, dict[str, Any]]] = []
    for index, reward in enumerate(rewards):  # split: a call per completion, all at once
        calls += [(index, single) for single in singles] if guard.splits(reward) else [(index, arguments)]
    split = any(guard.splits(reward) for reward in rewards)
    # split: as wide as the retries (hung completions cost one timeout together), the workers kept for the
    # next step's call (forking them anew every step would cost more than the scoring)
    outcomes = iter(guard.call(rewards, calls, RewardWorkers.RETRY_WIDTH if split else None, keep=split))
    results = []
    for index, reward in enumerate(rewards):
        if guard.splits(reward):
            results.append(
                _one_by_one(
                    guard, context, reward, [next(outcomes) for _ in range(count)], completions, origins
                )
            )
            continue
        outcome = next(outcomes)
        _merge_logs(context, outcome)
        if outcome.failure is None:
            results.append(_checked(reward, outcome.values, completions, origins))
            continue
        if guard.errors == "raise":
            raise _failed(reward, outcome, origins)
        # one call per completion, all at once in the workers: those that hang cost one timeout together
        alone = guard.call(rewards, [(index, single) for single in singles], RewardWorkers.RETRY_WIDTH)
        results.append(_one_by_one(guard, context, reward, alone, completions, origins))
    return results


def _one_by_one(
    guard: RewardGuard,
    context: RewardContext,
    reward: Reward,
    alone: list[Outcome],
    completions: list[Any],
    origins: list[str],
) -> list[float]:
    """A reward's values from one call per completion: the completions whose call failed unscorable (NaN)."""
    values = []
    for position, single in enumerate(alone):
        _merge_logs(context, single)
        if single.failure is not None:
            guard.count(reward.name, single.failure)
            guard.unscorable.add(position)
            values.append(math.nan)
        else:
            values.append(_checked(reward, single.values, [completions[position]], [origins[position]])[0])
    return values


def _merge_logs(context: RewardContext, outcome: Outcome) -> None:
    """What a worker's call logged (``log_extra``, ``log_metric``), into this process's context."""
    for column, values in (outcome.extra or {}).items():
        context.log_extra(column, values)
    for name, values in (outcome.logged or {}).items():
        for value in values:
            context.log_metric(name, value)


def _awaited_outcome(value: Any, timeout: float | None) -> Outcome:
    if isinstance(value, TimeoutError):
        return Outcome(failure="timeout", text=f"took more than {timeout:g} s (reward_timeout)")
    if isinstance(value, RewardError):
        raise value
    if isinstance(value, BaseException):
        return Outcome(failure="error", text=f"{type(value).__name__}: {value}", at=user_frame(value))
    return Outcome(values=value)


def _failed(reward: Reward, outcome: Outcome, origins: list[str]) -> RewardError:
    if outcome.failure == "timeout":
        return RewardError(
            f"reward {reward.name!r} ({reward.where()}) {outcome.text} scoring the completions of {rows_named(origins)}; "
            "raise reward_timeout, or set reward_errors: unscorable to leave such completions out"
        )
    if outcome.failure == "died":
        return RewardError(
            f"reward {reward.name!r} ({reward.where()}): {outcome.text}, scoring the completions of {rows_named(origins)}"
        )
    at = f" at {outcome.at}" if outcome.at else ""
    return RewardError(
        f"reward {reward.name!r} ({reward.where()}) raised {outcome.text}{at}, scoring the completions of "
        f"{rows_named(origins)}"
    )


def _as_number(value: Any) -> float | None:
    """A reward value as TRL takes it: None, a number or a bool (1.0 / 0.0), a NumPy scalar or a 0-d tensor;
    None for anything else (the caller says what it was)."""
    if hasattr(value, "ndim") and getattr(value, "ndim", 1) == 0 and hasattr(value, "item"):
        value = value.item()  # a NumPy scalar or a 0-d tensor (its value read back to the host)
    if isinstance(value, bool | int | float):
        return float(value)
    return None


def _checked(reward: Reward, values: Any, completions: list[Any], origins: list[str]) -> list[float]:
    array_like = hasattr(values, "__len__") and hasattr(values, "__getitem__")
    if isinstance(values, str | bytes | dict) or not array_like or len(values) != len(completions):
        count = len(values) if array_like and not isinstance(values, str | bytes) else type(values).__name__
        raise RewardError(
            f"reward {reward.name!r} ({reward.where()}) returned {count} values for {len(completions)} completions "
            f"(of {rows_named(origins)}); return one float or None per completion"
        )
    out = []
    for value, origin in zip(list(values), origins, strict=True):
        number = None if value is None else _as_number(value)
        if value is not None and number is None:
            raise RewardError(
                f"reward {reward.name!r} ({reward.where()}) returned {value!r} ({type(value).__name__}) for a "
                f"completion of {origin}; return a number, a bool or None"
            )
        out.append(math.nan if number is None else number)
    return out


def rows_named(origins: list[str]) -> str:
    unique = list(dict.fromkeys(origins))
    return ", ".join(unique[:3]) + (f" and {len(unique) - 3} more rows" if len(unique) > 3 else "")
