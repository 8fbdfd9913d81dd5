"""Reward functions: the built-ins and users' functions, called as TRL calls them, checked as they return.

Every reward is a callable ``(prompts, completions, completion_ids, **columns) -> list[float | None]`` (one
value per completion; None: this reward has nothing to say about it). ``prompts`` and ``completions`` are
strings for text prompts, message lists for chat prompts (a completion is then
``[{"role": "assistant", "content": ...}]``), as in TRL, so a TRL reward function works unchanged. Each
dataset column other than the prompt arrives as a keyword with one value per completion.

A reward that raises, returns the wrong number of values or a value that is not a number stops the run with a
:class:`RewardError` naming the function, its file and line, and the row of the prompt involved.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.grpo import (
    CodeTestsReward,
    ExactMatchReward,
    FunctionReward,
    LengthPenaltyReward,
    ModelReward,
    RegexReward,
    RewardConfig,
)
from posttrain.rollout.reward_guard import (
    Outcome,
    RewardContext,
    RewardError,
    RewardWorkers,
    bounded,
    call_here,
    one_by_one,
    user_frame,
)

RewardFunction = Callable[..., list[float | None]]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


#: what TRL hands a reward function besides the data, by its names
CONTEXT_KEYS = ("trainer_state", "log_extra", "log_metric")


# ------------------------------------------------------------------------------------------------ built-ins


def text_of(completion: Any) -> str:
    """A completion's text: itself, or the content of its last assistant message (its answer, after any
    tool calls and results)."""
    if isinstance(completion, str):
        return completion
    said = [m for m in completion if m.get("role", "assistant") == "assistant"]
    return str(said[-1].get("content", "")) if said else ""


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def same_answer(found: str | None, expected: Any) -> bool:
    """Equal as numbers when both read as numbers (``1,000`` = ``1000.0``), else as stripped text."""
    if found is None or expected is None:
        return False
    a, b = str(found).strip(), str(expected).strip()
    try:
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
    except ValueError:
        return a == b
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def exact_match(config: ExactMatchReward) -> RewardFunction:
    pattern = re.compile(config.pattern) if config.pattern else None

    def extract(text: str) -> str | None:
        if config.extract == "last_number":
            return last_number(text)
        if config.extract == "boxed":
            return last_boxed(text)
        if config.extract == "regex":
            assert pattern is not None
            found = pattern.findall(text)
            return found[-1] if found else None
        return text

    def reward(completions: Sequence[Any], **columns: Any) -> list[float | None]:
        if config.column not in columns:
            found = sorted(set(columns) - set(CONTEXT_KEYS))
            raise RewardError(
                f"exact_match reads the column {config.column!r}, which the rows do not have (they have: "
                f"{', '.join(found) or 'no other columns'}); set rewards[].column"
            )
        expected = columns[config.column]
        return [
            float(same_answer(extract(text_of(c)), e)) for c, e in zip(completions, expected, strict=True)
        ]

    reward.__name__ = "exact_match"
    return reward


def regex(config: RegexReward) -> RewardFunction:
    pattern = re.compile(config.pattern)
    test = pattern.fullmatch if config.match == "full" else pattern.search

    def reward(completions: Sequence[Any], **columns: Any) -> list[float | None]:
        return [float(test(text_of(c)) is not None) for c in completions]

    reward.__name__ = "regex"
    return reward


def length_penalty(config: LengthPenaltyReward, max_completion_length: int) -> RewardFunction:
    """DAPO's soft overlong punishment, on completion tokens."""
    limit, cache = max_completion_length, config.soft_punish_cache

    def reward(completion_ids: Sequence[Sequence[int]], **columns: Any) -> list[float | None]:
        out: list[float | None] = []
        for ids in completion_ids:
            n = len(ids)
            if n <= limit - cache:
                out.append(0.0)
            elif n <= limit and cache > 0:
                out.append((limit - cache - n) / cache)
            else:
                out.append(-1.0)
        return out

    reward.__name__ = "length_penalty"
    return reward


def code_tests(config: CodeTestsReward) -> RewardFunction:
    """The share of the row's tests each completion's last Python block passes, in the sandbox."""
    from concurrent.futures import ThreadPoolExecutor

    from posttrain.rollout.sandbox import Limits, last_code_block, tests_passed

    limits = Limits(
        wall=config.timeout,
        cpu=max(1, math.ceil(config.timeout)),
        memory=config.memory,
        processes=config.processes,
        disk=config.disk,
    )

    def reward(completions: Sequence[Any], **columns: Any) -> list[float | None]:
        if config.column not in columns:
            raise RewardError(
                f"code_tests reads the column {config.column!r}, which the rows do not have; set rewards[].column"
            )
        tests = [[t] if isinstance(t, str) else list(t or []) for t in columns[config.column]]
        codes = [last_code_block(text_of(c)) for c in completions]
        with ThreadPoolExecutor(max_workers=config.parallel) as pool:
            return list(
                pool.map(lambda pair: tests_passed(pair[0], pair[1], limits), zip(codes, tests, strict=True))
            )

    reward.__name__ = "code_tests"
    return reward


def user_function(config: FunctionReward) -> RewardFunction:
    from posttrain.config.user_code import import_user_module

    file, _, name = config.function.rpartition(":")
    return getattr(import_user_module(Path(file).expanduser().resolve()), name)


# -------------------------------------------------------------------------------------------------- calling


@dataclass
class Reward:
    name: str
    weight: float
    function: RewardFunction
    local: bool = False  # runs in the training process (an environment's reward), not in a reward worker

    def where(self) -> str:
        """The function's file and line."""
        function = inspect.unwrap(self.function)
        try:
            return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
        except (OSError, TypeError):
            return "a built-in"


def reward_model(config: ModelReward) -> RewardFunction:
    """Scores from a sequence-classification checkpoint: prompt and completion rendered with its tokenizer's
    chat template (text prompts are joined as text), padded on the right, ``batch_size`` at a time, on this
    process's GPU (its current CUDA device) or the CPU. Loaded on the first call."""
    import torch
    from transformers import AutoTokenizer

    from posttrain.models.reward_model import load_sequence_classifier, sequence_scores, set_pad_token

    loaded: dict[str, Any] = {}

    def texts(prompts: list[Any], completions: list[Any], tokenizer: Any) -> list[str]:
        if all(isinstance(p, str) for p in prompts):
            return [p + text_of(c) for p, c in zip(prompts, completions, strict=True)]
        return [
            tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
            for p, c in zip(prompts, completions, strict=True)
        ]

    def reward_model_score(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        if not loaded:
            cuda = torch.cuda.is_available()
            loaded["device"] = (
                torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            )
            tokenizer = AutoTokenizer.from_pretrained(config.model)
            tokenizer.padding_side, tokenizer.truncation_side = "right", "right"
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            model = load_sequence_classifier(config.model).to(loaded["device"]).eval()
            set_pad_token(model, tokenizer.pad_token_id)
            loaded.update(tokenizer=tokenizer, model=model)
        tokenizer, model, device = loaded["tokenizer"], loaded["model"], loaded["device"]
        scores: list[float] = []
        rendered = texts(prompts, completions, tokenizer)
        with torch.no_grad():
            for start in range(0, len(rendered), config.batch_size):
                batch = tokenizer(
                    rendered[start : start + config.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=config.max_length,
                    add_special_tokens=False,
                ).to(device)
                scores += sequence_scores(model, dict(batch)).tolist()
        return scores

    return reward_model_score


def build_rewards(configs: Sequence[RewardConfig], max_completion_length: int) -> list[Reward]:
    rewards = []
    for config in configs:
        if isinstance(config, ExactMatchReward):
            function = exact_match(config)
        elif isinstance(config, RegexReward):
            function = regex(config)
        elif isinstance(config, LengthPenaltyReward):
            function = length_penalty(config, max_completion_length)
        elif isinstance(config, FunctionReward):
            function = user_function(config)
        elif isinstance(config, ModelReward):
            function = reward_model(config)
        elif isinstance(config, CodeTestsReward):
            function = code_tests(config)
        else:
            function = config.build(max_completion_length)  # a reward defined elsewhere (a reward model)
        rewards.append(Reward(config.name or _name(config, function), float(config.weight), function))
    names = [r.name for r in rewards]
    for index, reward in enumerate(rewards):
        if names.count(reward.name) > 1:
            reward.name = f"{reward.name}_{index}"
    return rewards


def environment_rewards(config: Any) -> list[Reward]:
    """TRL's environment rewards: each environment class with a ``get_reward()`` scores the rollouts it ran
    (None for the others), weight 1, named after the class."""
    from posttrain.config.agents import scoring_environments

    out = []
    for cls in scoring_environments(getattr(config, "environment_factory", None)):

        def get_reward(environments: list[Any], _cls: Any = cls, **_: Any) -> list[float | None]:
            return [e.get_reward() if type(e) is _cls else None for e in environments]

        get_reward.__wrapped__ = cls.get_reward  # type: ignore[attr-defined]  # its errors name the user's line
        out.append(Reward(cls.__name__, 1.0, get_reward, local=True))
    return out


def _name(config: RewardConfig, function: Callable[..., Any]) -> str:
    return getattr(function, "__name__", None) or str(getattr(config, "type", "reward"))


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
        self, rewards: Sequence[Reward], calls: list[tuple[int, dict[str, Any]]], width: int | None = None
    ) -> list[Outcome]:
        """The outcome of each ``(reward index, arguments)`` call: in the workers (``width`` at a time; but for
        rewards that must run here), else here, ``async`` ones awaited together as TRL gathers them."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        remote = [i for i, (r, _) in enumerate(calls) if self.workers is not None and not rewards[r].local]
        if remote:
            assert self.workers is not None
            for i, outcome in zip(remote, self.workers.run([calls[i] for i in remote], width), strict=True):
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

    def count(self, name: str, kind: str) -> None:
        found = self.counts.setdefault(name, {"timeouts": 0, "errors": 0})
        found["timeouts" if kind == "timeout" else "errors"] += 1

    def take_counts(self) -> dict[str, dict[str, int]]:
        counts, self.counts = self.counts, {}
        return counts

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def guard_of(config: Any) -> RewardGuard:
    """The run's reward guard from its config (``reward_timeout``, ``reward_num_workers``, ``reward_errors``)."""
    timeout = getattr(config, "reward_timeout", None)
    count = getattr(config, "reward_num_workers", 0)
    limit = config.max_completion_length
    workers = RewardWorkers(count, list(config.rewards), limit, timeout, build_rewards) if count else None
    return RewardGuard(timeout, getattr(config, "reward_errors", "raise"), workers)


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
    outcomes = guard.call(rewards, [(i, arguments) for i in range(len(rewards))])
    results = []
    for index, (reward, outcome) in enumerate(zip(rewards, outcomes, strict=True)):
        _merge_logs(context, outcome)
        if outcome.failure is None:
            results.append(_checked(reward, outcome.values, completions, origins))
            continue
        if guard.errors == "raise":
            raise _failed(reward, outcome, origins)
        count = len(completions)
        # one call per completion, all at once in the workers: those that hang cost one timeout together
        alone = guard.call(
            rewards, [(index, single) for single in one_by_one(arguments, count)], RewardWorkers.RETRY_WIDTH
        )
        values = []
        for position, single in enumerate(alone):
            _merge_logs(context, single)
            if single.failure is not None:
                guard.count(reward.name, single.failure)
                guard.unscorable.add(position)
                values.append(math.nan)
            else:
                values.append(
                    _checked(reward, single.values, [completions[position]], [origins[position]])[0]
                )
        results.append(values)
    return results


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
            f"reward {reward.name!r} ({reward.where()}) {outcome.text} scoring the completions of {_rows(origins)}; "
            "raise reward_timeout, or set reward_errors: unscorable to leave such completions out"
        )
    if outcome.failure == "died":
        return RewardError(
            f"reward {reward.name!r} ({reward.where()}): {outcome.text}, scoring the completions of {_rows(origins)}"
        )
    at = f" at {outcome.at}" if outcome.at else ""
    return RewardError(
        f"reward {reward.name!r} ({reward.where()}) raised {outcome.text}{at}, scoring the completions of "
        f"{_rows(origins)}"
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
            f"(of {_rows(origins)}); return one float or None per completion"
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


def _rows(origins: list[str]) -> str:
    unique = list(dict.fromkeys(origins))
    return ", ".join(unique[:3]) + (f" and {len(unique) - 3} more rows" if len(unique) > 3 else "")


def completions_as_prompted(prompt: Any, text: str) -> Any:
    """TRL's convention: text for a text prompt, an assistant message for a chat prompt."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


class Scorer:
    """The rewards of a list of completions: every function, then their weighted sum (NaN counts as 0,
    TRL's ``nansum``)."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        import torch

        self.rewards: list[Reward] = build_rewards(config.rewards, config.max_completion_length)
        self.rewards += environment_rewards(config)
        self.guard = guard_of(config)  # reward_timeout, reward_num_workers, reward_errors
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        self.tokenizer = tokenizer
        self.context = RewardContext()  # trainer_state, log_extra, log_metric: TRL's extra arguments
        self.unscored: list[str] = []  # the last call's completions every function returned None for
        self.last_count = 0

    def __call__(self, rows: list[dict[str, Any]], completions: Any) -> Any:
        """``[completions, rewards]`` float64 (NaN where a function returned None)."""
        import torch

        from posttrain.data.grpo import ORIGIN_KEY, prompt_of, reward_columns

        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        self.last_count = len(rows)
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
        self.unscored = [o for i, o in enumerate(origins) if none[i] and i not in self.guard.unscorable]
        for index in self.guard.unscorable:  # no reward counts for it: advantage 0, out of its group
            out[index] = math.nan
        return out

    def all_none_line(self, dist: Any) -> str:
        """A line when every reward function returned None for some completions of the last call, on any rank
        (TRL warns too): they are left out of their group and of ``reward``. A collective: every rank calls
        it."""
        from posttrain.dist import all_reduce_sum

        count, total = all_reduce_sum([float(len(self.unscored)), float(self.last_count)], dist)
        if not count:
            return ""
        example = f" (among them the completions of {_rows(self.unscored)})" if self.unscored else ""
        return (
            f"every reward function returned None for {int(count)} of the step's {int(total)} completions"
            f"{example}: no reward scores them, so they are left out of their group's advantage (0) and of the "
            f"logged reward{' (nan when none is scored)' if count == total else ''}. Return a number where a "
            f"completion can be scored (rewards: {', '.join(f'{r.name} ({r.where()})' for r in self.rewards)})"
        )

    def failure_records(self, dist: Any) -> dict[str, float]:
        """Each reward's timed-out and failed completions since the last call, summed over the ranks
        (``reward_errors: unscorable``; under ``raise`` the first failure stops the run)."""
        from posttrain.dist import all_reduce_sum

        counts = self.guard.take_counts()
        if self.guard.errors != "unscorable":
            return {}
        names = [r.name for r in self.rewards]
        local = [float(counts.get(n, {}).get(kind, 0)) for n in names for kind in ("timeouts", "errors")]
        totals = all_reduce_sum(local, dist)
        return {
            f"rewards/{name}/{kind}": totals[2 * i + k]
            for i, name in enumerate(names)
            for k, kind in enumerate(("timeouts", "errors"))
        }

    def total(self, values: Any) -> Any:
        """The weighted sum of each completion's rewards (a None counts as 0, TRL's ``nansum``); NaN for a
        completion no reward function scored, which TRL leaves out of its group (advantage 0) and of the
        logged reward."""
        import torch

        totals = (values * self.weights).nansum(dim=1)
        return totals.masked_fill(torch.isnan(values).all(dim=1), math.nan)
