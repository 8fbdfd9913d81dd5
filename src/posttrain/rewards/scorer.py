"""The rewards of a step's completions (``Scorer``): every reward function called through the run's guard,
their weighted sum, and what the run records and says of them (each function's failures, what the functions
logged, completions no function scored)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from posttrain.config.rewards import ScoredConfig
from posttrain.dist import DistInfo, all_gather_objects, all_reduce_sum
from posttrain.generation.types import Completions
from posttrain.logs import say
from posttrain.rewards.calls import RewardContext
from posttrain.rewards.functions import Reward, build_rewards, environment_rewards
from posttrain.rewards.guard import RewardGuard, rows_named, score_all
from posttrain.rewards.workers import RewardWorkers
from posttrain.training.extras import COUNT


def guard_of(config: ScoredConfig) -> RewardGuard:
    """The run's reward guard from its config (``reward_timeout``, ``reward_num_workers``, ``reward_errors``)."""
    timeout, count, limit = config.reward_timeout, config.reward_num_workers, config.max_completion_length
    workers = RewardWorkers(count, list(config.rewards), limit, timeout, build_rewards) if count else None
    return RewardGuard(timeout, config.reward_errors, workers)


def completions_as_prompted(prompt: Any, text: str) -> Any:
    """TRL's convention: text for a text prompt, an assistant message for a chat prompt."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


#: the fields of a completions.jsonl line a reward's ``log_extra`` column must not take (it is prefixed)
LOG_FIELDS = (
    "generation",
    "epoch",
    "batch",
    "prompt",
    "prompt_as_seen",
    "completion",
    "truncated",
    "messages",
    "reward",
    "rewards",
    "advantage",
    "policy_version",
    "origin",
)


@dataclass
class Scores:
    """One call's rewards: ``values`` ``[completions, rewards]`` float64 (NaN where a function returned None,
    and for every function of a completion left unscorable), what the functions logged (``extra``: columns
    of the completions log; ``logged``: ``log_metric`` values) and the completions every function returned
    None for (``unscored``, by origin)."""

    values: torch.Tensor
    extra: dict[str, list[Any]]
    logged: dict[str, list[float]]
    unscored: list[str]


class Scorer:
    """The rewards of a list of completions and what the run records of them: every function called through
    the run's guard (``reward_timeout``, ``reward_num_workers``, ``reward_errors``) with TRL's arguments,
    their weighted sum (NaN counts as 0, TRL's ``nansum``), the step's records of what the functions logged
    and of their failures, each completion's fields in the completions log, and held-out metrics. Every
    method that scores its completions (grpo, or one written from ``docs/extending.md``) holds one."""

    def __init__(self, config: ScoredConfig, tokenizer: Any) -> None:
        self.rewards: list[Reward] = build_rewards(
            config.rewards, config.max_completion_length, getattr(config, "sandbox_accept_weaker", False)
        )
        self.rewards += environment_rewards(config)
        self.guard = guard_of(config)
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        self.tokenizer = tokenizer
        self.context = RewardContext()  # trainer_state, log_extra, log_metric: TRL's extra arguments
        self.none_said = False  # the line for completions no function scored, once a run

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def describe(self) -> str:
        return ", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards)

    def score(
        self, rows: list[dict[str, Any]], completions: Completions, trainer_state: Any = None
    ) -> Scores:
        """Every function's values for the rows' completions (one per row), with what they logged."""
        from posttrain.data.prompts import ORIGIN_KEY, prompt_of, reward_columns

        self.context.trainer_state = trainer_state
        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        prompts = [prompt_of(row) for row in rows]
        columns: dict[str, list[Any]] = {}
        for index, row in enumerate(rows):
            for key, value in reward_columns(row).items():
                columns.setdefault(key, [None] * len(rows))[index] = value
        origins = [str(row.get(ORIGIN_KEY, "a row")) for row in rows]
        shown = completions.messages or [
            completions_as_prompted(p, t) for p, t in zip(prompts, texts, strict=True)
        ]
        columns.update(completions.columns or {})  # what a rollout_func returned for the rewards
        if completions.environments is not None:
            columns["environments"] = completions.environments
        values = score_all(
            self.rewards, prompts, shown, completions.ids, columns, origins, self.context, self.guard
        )
        out = torch.tensor(values, dtype=torch.float64).T.reshape(len(rows), len(self.rewards))
        none = torch.isnan(out).all(dim=1).tolist()
        unscored = [o for i, o in enumerate(origins) if none[i] and i not in self.guard.unscorable]
        for index in self.guard.unscorable:  # no reward counts for it: advantage 0, out of its group
            out[index] = math.nan
        extra, logged = self.context.take()
        return Scores(out, extra, logged, unscored)

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each completion's rewards (a None counts as 0, TRL's ``nansum``); NaN for a
        completion no reward function scored, which TRL leaves out of its group (advantage 0) and of the
        logged reward."""
        totals = (values * self.weights).nansum(dim=1)
        return totals.masked_fill(torch.isnan(values).all(dim=1), math.nan)

    # ------------------------------------------------------------------------------------- what is recorded

    def step_records(self, scores: Scores, dist: DistInfo) -> dict[str, float]:
        """The step's records of the rewards beyond their values (every rank's, so a collective: every rank
        calls it): each ``log_metric`` name's mean, each function's failures (``reward_errors:
        unscorable``); and the line, once a run, for completions no function scored."""
        records = self._logged_metrics(scores.logged, dist)
        records.update(self._failure_records(dist))
        line = self.none_scored_line(scores, dist)
        if line and not self.none_said:
            say(line)
            self.none_said = True
        return records

    def completion_fields(self, scores: Scores, index: int) -> dict[str, Any]:
        """A completion's fields in the completions log: each function's value and the columns the functions
        added (``log_extra``; prefixed ``extra/`` where they would take a built-in field's name)."""
        fields: dict[str, Any] = {
            "rewards": {n: _plain(float(scores.values[index, i])) for i, n in enumerate(self.names)}
        }
        for column, logged in scores.extra.items():
            key = column if column not in LOG_FIELDS else f"extra/{column}"
            fields[key] = _json_value(logged[index]) if index < len(logged) else None
        return fields

    def evaluation(
        self, rows: list[dict[str, Any]], completions: Completions, weight: torch.Tensor, trainer_state: Any
    ) -> dict[str, torch.Tensor]:
        """Held-out metrics of the rows' (greedy) completions, as sums and counts over the completions each
        function scored (``weight``: each row's share); what the functions log and their failures are not
        recorded."""
        scores = self.score(rows, completions, trainer_state)
        self.guard.take_counts()
        totals = self.total(scores.values)
        scored = (~torch.isnan(totals)).double() * weight
        metrics = {"reward": (torch.nan_to_num(totals) * scored).sum(), "reward" + COUNT: scored.sum()}
        for index, name in enumerate(self.names):
            column = scores.values[:, index]
            seen = (~torch.isnan(column)).double() * weight
            metrics[f"rewards/{name}"] = (torch.nan_to_num(column) * seen).sum()
            metrics[f"rewards/{name}{COUNT}"] = seen.sum()
        return metrics

    def close(self) -> None:
        self.guard.close()

    def none_scored_line(self, scores: Scores, dist: DistInfo) -> str:
        """A line when every reward function returned None for some completions, on any rank (TRL warns
        too): they are left out of their group and of ``reward``."""
        count, total = all_reduce_sum([float(len(scores.unscored)), float(scores.values.shape[0])], dist)
        if not count:
            return ""
        example = f" (among them the completions of {rows_named(scores.unscored)})" if scores.unscored else ""
        return (
            f"every reward function returned None for {int(count)} of the step's {int(total)} completions"
            f"{example}: no reward scores them, so they are left out of their group's advantage (0) and of the "
            f"logged reward{' (nan when none is scored)' if count == total else ''}. Return a number where a "
            f"completion can be scored (rewards: {', '.join(f'{r.name} ({r.where()})' for r in self.rewards)})"
        )

    def _failure_records(self, dist: DistInfo) -> dict[str, float]:
        """Each reward's timed-out and failed completions since the last call, summed over the ranks
        (``reward_errors: unscorable``; under ``raise`` the first failure stops the run)."""
        counts = self.guard.take_counts()
        if self.guard.errors != "unscorable":
            return {}
        local = [float(counts.get(n, {}).get(kind, 0)) for n in self.names for kind in ("timeouts", "errors")]
        totals = all_reduce_sum(local, dist)
        return {
            f"rewards/{name}/{kind}": totals[2 * i + k]
            for i, name in enumerate(self.names)
            for k, kind in enumerate(("timeouts", "errors"))
        }

    @staticmethod
    def _logged_metrics(logged: dict[str, list[float]], dist: DistInfo) -> dict[str, float]:
        """The rewards' ``log_metric`` values: each name's mean over every call on every rank (names gathered
        from all ranks, so that a name logged on one rank only still reduces)."""
        everyone: list[Any] = all_gather_objects(sorted(logged), dist)
        names = {name for found in everyone for name in found}
        ordered = sorted(names)
        local = [x for n in ordered for x in (sum(logged.get(n, [])), float(len(logged.get(n, []))))]
        totals = all_reduce_sum(local, dist) if local else []
        return {
            name: totals[2 * i] / totals[2 * i + 1] if totals[2 * i + 1] else math.nan
            for i, name in enumerate(ordered)
        }


def _plain(value: float) -> float | None:
    return None if math.isnan(value) else value


def _json_value(value: Any) -> Any:
    """A value a reward logged, as JSON holds it: numbers (NaN as null), text, bools, lists; others as text."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic) and value.ndim == 0:
        value = value.item()
    if isinstance(value, float):
        return _plain(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return str(value)
