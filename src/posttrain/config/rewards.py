"""The reward keys of an online method that scores its completions (grpo, and any scored method written from
``docs/extending.md``): ``rewards`` (built-ins, users' functions, reward models, the code reward) and how they
are called (``reward_timeout``, ``reward_num_workers``, ``reward_errors``), TRL's names where TRL has them. A
user function is imported when the config loads (as ``code:`` is), so a missing file or function is a config
error before anything runs. The functions themselves are ``rewards.functions``'."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from posttrain.config.base import BaseConfig, Problem
from posttrain.config.human import HumanFloat, HumanInt
from posttrain.config.online import OnlineTrainerConfig
from posttrain.config.prompts import PromptsDataConfig


class RewardConfig(BaseConfig):
    weight: HumanFloat = 1.0
    """This reward's weight in the sum that makes a completion's reward."""

    name: str | None = None
    """The name its mean is logged under (``rewards/<name>``); default: the function's or the type's."""


class ExactMatchReward(RewardConfig):
    """1 when the answer extracted from the completion equals the row's ``column`` (numbers compared as
    numbers), else 0."""

    type: Literal["exact_match"] = "exact_match"
    """A built-in reward: compare an extracted answer with a column."""

    column: str = "answer"
    """The data column holding the expected answer."""

    extract: Literal["none", "last_number", "boxed", "regex"] = "last_number"
    """What of the completion is compared: all of it (stripped), its last number, the content of its last
    ``\\boxed{...}``, or the first group of ``pattern``'s last match."""

    pattern: str | None = None
    """A regular expression with one group (``extract: regex``)."""

    def problems(self) -> Iterator[Problem]:
        if self.extract == "regex" and not self.pattern:
            yield Problem("pattern", "extract: regex needs a pattern with one group, e.g. 'Answer: (.+)'")
        if self.pattern:
            yield from _pattern_problems(self.pattern, groups=1 if self.extract == "regex" else None)


class RegexReward(RewardConfig):
    """A format reward: 1 when the completion matches ``pattern``, else 0."""

    type: Literal["regex"] = "regex"
    """A built-in reward: a format check."""

    pattern: str
    """The regular expression (Python syntax; ``(?s)`` lets ``.`` match newlines)."""

    match: Literal["search", "full"] = "search"
    """search: anywhere in the completion; full: the whole completion."""

    def problems(self) -> Iterator[Problem]:
        yield from _pattern_problems(self.pattern, groups=None)


class LengthPenaltyReward(RewardConfig):
    """DAPO's soft overlong punishment (TRL's ``get_soft_overlong_punishment``): 0 up to
    ``max_completion_length - soft_punish_cache`` tokens, falling linearly to -1 at ``max_completion_length``,
    -1 beyond."""

    type: Literal["length_penalty"] = "length_penalty"
    """A built-in reward: DAPO's soft overlong punishment."""

    soft_punish_cache: HumanInt = Field(default=0, ge=0)
    """The last tokens before the limit over which the penalty grows (0: -1 only for truncated completions)."""


class FunctionReward(RewardConfig):
    """A user function, ``path/to/file.py:function``, called as TRL calls reward functions:
    ``function(prompts=..., completions=..., completion_ids=..., **columns)``, returning one float (or None)
    per completion. Imported when the config is loaded (the path is relative to where posttrain runs)."""

    type: Literal["function"] = "function"
    """A user's reward function."""

    function: str
    """``path/to/file.py:function``."""

    @field_validator("function")
    @classmethod
    def _importable(cls, value: str) -> str:
        from posttrain.config.user_code import import_named

        import_named(value)
        return value


class ModelReward(RewardConfig):
    """A reward model's score of each prompt and completion: an export of ``type: reward`` or any one-label
    sequence-classification checkpoint, with its own tokenizer and chat template, run on the training device
    in batches (each process scores its own completions, holding the whole reward model)."""

    type: Literal["model"] = "model"
    """A reward model."""

    model: str
    """Its directory (or Hugging Face name): ``AutoModelForSequenceClassification`` with one label."""

    batch_size: HumanInt = Field(default=16, ge=1)
    """Completions scored per forward pass."""

    max_length: HumanInt = Field(default=4096, ge=2)
    """Prompt and completion are cut to this many tokens (their start kept) before scoring."""


class CodeTestsReward(RewardConfig):
    """The share of the row's tests that the completion's last Python block passes, run in the sandbox
    (``sandbox.confine``: namespaces of its own, a read-only system, no network, memory, processes and disk
    limited for the whole run, none of the parent's environment; ``posttrain sandbox check``). Each test runs
    whole in a second sandbox that never runs the program, with the real builtins; the names it does not
    define (builtins' names aside) are the program's, which answers for them with plain data
    (``sandbox.code_tests``), so a program answers for its own functions and cannot forge its score. 0
    without a code block."""

    type: Literal["code_tests"] = "code_tests"
    """A built-in reward: run the code against tests."""

    column: str = "tests"
    """The data column holding the tests: a list of tests, each one or more statements (``assert f(2) == 4``,
    setup, loops, ``try``/``except`` of the program's exceptions); a test passes when it runs to its end."""

    timeout: HumanFloat = Field(default=10.0, gt=0.0)
    """Wall-clock seconds a completion's judgement may take, the program's and the tests' sandboxes together
    (each one's CPU time is limited to the same); ``reward_timeout`` ends them sooner."""

    memory: HumanInt = Field(default=512 * 2**20, gt=0)
    """Memory of the program and everything it starts, in bytes (``512Mi``); also each process's address
    space."""

    processes: HumanInt = Field(default=32, ge=1)
    """Processes the program may run at once."""

    disk: HumanInt = Field(default=64 * 2**20, gt=0)
    """Bytes the program may write in all (its directory, ``/tmp`` and ``/dev/shm``)."""

    parallel: HumanInt = Field(default=4, ge=1)
    """Completions run at once."""


def _reward_entry(value: Any) -> Any:
    """A plain string is a user function (``file.py:function``); a dict without a type names its type by
    its one distinctive key."""
    if isinstance(value, str):
        return {"type": "function", "function": value}
    if isinstance(value, dict) and "type" not in value and "function" in value:
        return {**value, "type": "function"}
    if isinstance(value, dict) and "type" not in value and "model" in value:
        return {**value, "type": "model"}
    return value


Reward = Annotated[
    ExactMatchReward | RegexReward | LengthPenaltyReward | FunctionReward | ModelReward | CodeTestsReward,
    Field(discriminator="type"),
    BeforeValidator(_reward_entry),
]


def _pattern_problems(pattern: str, groups: int | None) -> Iterator[Problem]:
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        yield Problem("pattern", f"{pattern!r} is not a regular expression: {exc}")
        return
    if groups is not None and compiled.groups != groups:
        yield Problem(
            "pattern", f"{pattern!r} has {compiled.groups} groups; extract: regex takes the first of one"
        )


class ScoredConfig(OnlineTrainerConfig):
    """An online method whose completions are scored by reward functions (and environments' ``get_reward``)."""

    rewards: list[Reward] = Field(default_factory=list)
    """The reward functions, each with a ``weight``: built-ins (``{type: exact_match, column: answer}``,
    ``{type: regex, pattern: ...}``, ``{type: length_penalty}``, ``{type: code_tests}``) or user functions
    (``path/file.py:fn``). May be empty when an environment scores the rollouts (``get_reward``)."""

    reward_timeout: HumanFloat | None = Field(default=None, gt=0.0)
    """Seconds a reward function may take for one call (a rank's completions of a batch); past it the call is
    stopped and counts as failed (``reward_errors``). Null: no limit. In the training process the limit is a
    ``SIGALRM`` timer (it stops Python code and sleeps, not a C call that ignores signals); in reward workers
    the worker is killed and replaced."""

    reward_num_workers: HumanInt = Field(default=0, ge=0)
    """Score in this many worker processes (the rewards' calls in parallel; a worker that dies or times out is
    replaced). 0: in the training process. Environment rewards always run in the training process."""

    reward_errors: Literal["raise", "unscorable"] = "raise"
    """What a reward that raises or times out does. raise: stop the run naming the function, its file and
    line, and the rows. unscorable: find the completions it fails on (scored one by one) and leave them
    unscorable (advantage 0, out of their group's statistics); counted in ``rewards/<name>/timeouts`` and
    ``rewards/<name>/errors``. With ``reward_timeout`` and ``reward_num_workers``, each completion is scored by
    a call of its own from the start (a function sees one completion a call), so a hung completion costs one
    timeout and no completion's value depends on another's."""

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if not self.rewards and not self._environment_scores():
            yield Problem(
                "rewards",
                "empty: name at least one reward function (or an environment_factory whose class has get_reward)",
            )

    @model_validator(mode="after")
    def _reward_columns(self) -> ScoredConfig:
        """The columns the built-in rewards read must be in every row: checked when the data is built."""
        if isinstance(self.data, PromptsDataConfig):
            wanted = [r.column for r in self.rewards if isinstance(r, ExactMatchReward | CodeTestsReward)]
            self.data.reward_columns = list(dict.fromkeys([*self.data.reward_columns, *wanted]))
        return self

    def _environment_scores(self) -> bool:
        from posttrain.config.agents import scoring_environments

        try:
            return bool(scoring_environments(self.environment_factory))
        except ValueError:
            return False  # the environment's own error is reported
