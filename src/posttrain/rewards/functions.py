"""What a reward is: the built-ins, users' functions, reward models and environments' ``get_reward``, each a
callable ``(prompts, completions, completion_ids, **columns) -> list[float | None]`` (one value per
completion; None: this reward has nothing to say about it). ``prompts`` and ``completions`` are strings for
text prompts, message lists for chat prompts (a completion is then ``[{"role": "assistant", "content":
...}]``; in an agent run, the whole trajectory), as in TRL, so a TRL reward function works unchanged. Each
dataset column other than the prompt arrives as a keyword with one value per completion. How they are called
and checked is ``reward_guard``'s; the step's scoring, ``scorer``'s."""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.rewards import (
    CodeTestsReward,
    ExactMatchReward,
    FunctionReward,
    LengthPenaltyReward,
    ModelReward,
    RegexReward,
    RewardConfig,
)
from posttrain.rewards.calls import CONTEXT_KEYS, RewardError

RewardFunction = Callable[..., list[float | None]]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


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


def code_tests(config: CodeTestsReward, strict: bool = True) -> RewardFunction:
    """The share of the row's tests each completion's last Python block passes, in the sandbox (``strict``
    False: with what holds where the kernel makes no namespaces, the run's ``sandbox_accept_weaker``)."""
    from concurrent.futures import ThreadPoolExecutor

    from posttrain.sandbox.code_tests import last_code_block, tests_passed
    from posttrain.sandbox.confine import Limits

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
        cancel = threading.Event()
        pool = ThreadPoolExecutor(max_workers=config.parallel)
        try:
            return list(
                pool.map(
                    lambda pair: tests_passed(pair[0], pair[1], limits, strict, cancel),
                    zip(codes, tests, strict=True),
                )
            )
        finally:  # reward_timeout in this process: the sandboxes end now, not at their own wall time
            cancel.set()
            pool.shutdown(wait=False, cancel_futures=True)

    reward.__name__ = "code_tests"
    return reward


def user_function(config: FunctionReward) -> RewardFunction:
    from posttrain.config.user_code import import_user_module

    file, _, name = config.function.rpartition(":")
    return getattr(import_user_module(Path(file).expanduser().resolve()), name)


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


def build_rewards(
    configs: Sequence[RewardConfig], max_completion_length: int, accept_weaker_sandbox: bool = False
) -> list[Reward]:
    """The run's reward functions (``accept_weaker_sandbox``: the run's ``sandbox_accept_weaker``)."""
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
            function = code_tests(config, strict=not accept_weaker_sandbox)
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
