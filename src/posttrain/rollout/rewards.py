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
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.config.grpo import (
    ExactMatchReward,
    FunctionReward,
    LengthPenaltyReward,
    ModelReward,
    RegexReward,
    RewardConfig,
)
from posttrain.errors import UserError

RewardFunction = Callable[..., list[float | None]]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(UserError):
    """A reward function failed on real data: which function, where, on which row."""


#: what TRL hands a reward function besides the data, by its names
CONTEXT_KEYS = ("trainer_state", "log_extra", "log_metric")


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


# ------------------------------------------------------------------------------------------------ built-ins


def text_of(completion: Any) -> str:
    """A completion's text: itself, or the content of its messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


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
        else:
            function = config.build(max_completion_length)  # a reward defined elsewhere (a reward model)
        rewards.append(Reward(config.name or _name(config, function), float(config.weight), function))
    names = [r.name for r in rewards]
    for index, reward in enumerate(rewards):
        if names.count(reward.name) > 1:
            reward.name = f"{reward.name}_{index}"
    return rewards


def _name(config: RewardConfig, function: Callable[..., Any]) -> str:
    return getattr(function, "__name__", None) or str(getattr(config, "type", "reward"))


def score_all(
    rewards: Sequence[Reward],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    origins: list[str],
    context: RewardContext | None = None,
) -> list[list[float]]:
    """Every reward's values for the completions: plain functions in turn, ``async def`` ones (or any that
    return an awaitable) awaited together, as TRL gathers its async reward functions. Each is called with
    TRL's arguments: the prompts, completions and their ids, every other column of the rows, and the
    ``context`` (``trainer_state``, ``log_extra``, ``log_metric``)."""
    arguments = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    arguments.update((context or RewardContext()).arguments())
    results: list[Any] = [_call(reward, arguments, origins) for reward in rewards]
    pending = [i for i, value in enumerate(results) if inspect.isawaitable(value)]
    if pending:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(results[i] for i in pending), return_exceptions=True)

        for index, value in zip(pending, asyncio.run(gather()), strict=True):
            if isinstance(value, BaseException):
                raise _raised(rewards[index], value, origins) from None
            results[index] = value
    return [
        _checked(reward, values, completions, origins)
        for reward, values in zip(rewards, results, strict=True)
    ]


def _call(reward: Reward, arguments: dict[str, Any], origins: list[str]) -> Any:
    try:
        return reward.function(**arguments)
    except RewardError:
        raise
    except Exception as exc:
        raise _raised(reward, exc, origins) from None


def _raised(reward: Reward, exc: BaseException, origins: list[str]) -> RewardError:
    if isinstance(exc, RewardError):
        return exc
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return RewardError(
        f"reward {reward.name!r} ({reward.where()}) raised {type(exc).__name__}: {exc}{at}, scoring the "
        f"completions of {_rows(origins)}"
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
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        self.tokenizer = tokenizer
        self.context = RewardContext()  # trainer_state, log_extra, log_metric: TRL's extra arguments

    def __call__(self, rows: list[dict[str, Any]], completions: Any) -> Any:
        """``[completions, rewards]`` float64 (NaN where a function returned None)."""
        import torch

        from posttrain.data.grpo import ORIGIN_KEY, prompt_of, reward_columns

        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        prompts = [prompt_of(row) for row in rows]
        columns: dict[str, list[Any]] = {}
        for index, row in enumerate(rows):
            for key, value in reward_columns(row).items():
                columns.setdefault(key, [None] * len(rows))[index] = value
        origins = [str(row.get(ORIGIN_KEY, "a row")) for row in rows]
        shown = [completions_as_prompted(p, t) for p, t in zip(prompts, texts, strict=True)]
        values = score_all(self.rewards, prompts, shown, completions.ids, columns, origins, self.context)
        return torch.tensor(values, dtype=torch.float64).T.reshape(len(rows), len(self.rewards))

    def total(self, values: Any) -> Any:
        """The weighted sum of each completion's rewards (a None counts as 0, TRL's ``nansum``); NaN for a
        completion no reward function scored, which TRL leaves out of its group (advantage 0) and of the
        logged reward."""
        import torch

        totals = (values * self.weights).nansum(dim=1)
        return totals.masked_fill(torch.isnan(values).all(dim=1), math.nan)
