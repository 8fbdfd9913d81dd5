"""Config of the ``grpo`` trainer (online RL from rewards: GRPO, DAPO, Dr. GRPO, RLOO, GSPO) and its data.

The top-level keys are named as in TRL's ``GRPOConfig`` (``num_generations``, ``max_completion_length``,
``beta``, ``epsilon``, ``epsilon_high``, ``num_iterations``, ``loss_type``, ``scale_rewards``...) so that a TRL
user's settings carry over. Reward functions are named in ``rewards``; a user function is imported when the
config is loaded (as ``code:`` is), so a missing file or function is a config error before anything runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from posttrain.config.base import BaseConfig, ModeKeys, Problem
from posttrain.config.data import PromptDataConfig
from posttrain.config.fp8 import frozen_model_problems
from posttrain.config.human import HumanFloat, HumanInt
from posttrain.config.model import ModelConfig
from posttrain.config.online import OnlineTrainerConfig


class GRPODataConfig(PromptDataConfig):
    """Prompt rows: ``prompt`` as a list of messages or plain text (TRL's layout), or chat rows
    (``messages``) ending with a user turn. Every other column is handed to the reward functions."""

    reward_columns: list[str] = Field(default_factory=list)
    """Columns every row must hold (a row without one is a bad row, reported with its file and row when the
    data is built); the columns the built-in rewards read are added to it."""

    tool_schemas: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    """Filled from ``tools`` and ``environment_factory`` (not set by hand): the tools' JSON schemas each prompt
    is rendered with, by environment name (``""``: every row; otherwise the row's ``environment``)."""

    unsupported: ClassVar[dict[str, str]] = {
        "pack_samples": "prompts are generated from one by one; completions are batched per group",
        "padding_free": "completions are batched as padded rows",
    }


# ------------------------------------------------------------------------------------------------ rewards


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
    (``rollout.sandbox``: namespaces of its own, a read-only system, no network, memory, processes and disk
    limited for the whole run, none of the parent's environment; ``posttrain sandbox check``). A test's
    expressions are evaluated in the sandbox and its comparisons made outside it, so the program cannot forge
    its score. 0 without a code block."""

    type: Literal["code_tests"] = "code_tests"
    """A built-in reward: run the code against tests."""

    column: str = "tests"
    """The data column holding the tests: a list of tests, each one or more statements (``assert f(2) == 4``;
    a top-level ``assert`` comparison is compared outside the sandbox, other statements run inside)."""

    timeout: HumanFloat = Field(default=10.0, gt=0.0)
    """Wall-clock seconds a completion's program may run (its CPU time is limited to the same)."""

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


def _scale(value: Any) -> Any:
    """TRL also takes booleans: true is ``group``, false is ``none``."""
    return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


# ------------------------------------------------------------------------------------------------ trainer


class GRPOTrainerConfig(OnlineTrainerConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        *OnlineTrainerConfig.mode_keys,
        ModeKeys(
            ("ref_model", "use_bias_correction_kl"),
            lambda c, root: c.beta > 0,
            "beta > 0 (a KL penalty to the reference)",
        ),
        ModeKeys(
            ("epsilon", "epsilon_high", "importance_sampling_level"),
            lambda c, root: c.loss_type != "reinforce",
            "a clipped loss_type (grpo, dapo, dr_grpo)",
        ),
        ModeKeys(
            (
                "vllm_importance_sampling_correction",
                "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_min",
                "vllm_importance_sampling_clip_max",
            ),
            lambda c, root: c.use_vllm,
            "use_vllm: true",
        ),
    )
    type: str = "grpo"
    """Trainer type."""

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
    ``rewards/<name>/errors``."""

    num_generations: HumanInt = 8
    """Completions sampled per prompt (the group). The global batch counts completions, so it must be a
    multiple of this; the prompts per step are the global batch / num_generations."""

    beta: HumanFloat = Field(default=0.0, ge=0.0)
    """Weight of the KL penalty to the reference (the k3 estimator per token). 0 loads no reference model."""

    use_bias_correction_kl: bool = True
    """TRL's name and default: the KL term is multiplied by the importance ratio (not clipped; per completion
    under ``importance_sampling_level: sequence``), so that its gradient is the unbiased reverse-KL gradient
    (DeepSeek-V3.2). It changes the KL gradient even on-policy, where the ratio is 1 but differentiable."""

    ref_model: ModelConfig | None = None
    """The frozen reference for ``beta > 0``. Null: the policy's initial weights (with adapters: the base
    model, the adapters switched off)."""

    epsilon: HumanFloat = Field(default=0.2, gt=0.0)
    """Clipping of the importance ratio: below at 1 - epsilon."""

    epsilon_high: HumanFloat | None = Field(default=None, gt=0.0)
    """Clipping above at 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28); null: epsilon."""

    num_iterations: HumanInt = Field(default=1, ge=1)
    """Optimizer steps on each generated batch (the old policy's log-probabilities are kept for the ratio)."""

    loss_type: Literal["grpo", "dapo", "dr_grpo", "reinforce"] = "dapo"
    """How token losses are averaged: grpo (each completion's token mean, then the mean over completions),
    dapo (over every completion token of the step, all ranks), dr_grpo (summed per completion over
    max_completion_length, mean over completions); reinforce: REINFORCE without a ratio or clipping (on-policy
    only), normalised as grpo."""

    scale_rewards: Annotated[Literal["group", "batch", "none"], BeforeValidator(_scale)] = "group"
    """Advantages divided by the standard deviation of the group's rewards, of the whole step's (batch), or
    not at all (Dr. GRPO)."""

    advantage: Literal["grpo", "rloo"] = "grpo"
    """The baseline a reward is compared with: the group's mean (grpo) or the mean of the group's other
    completions (rloo, leave-one-out)."""

    importance_sampling_level: Literal["token", "sequence"] = "token"
    """The ratio per token, or one per completion from its tokens' mean log-ratio (GSPO)."""

    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length (no end-of-turn token) out of the loss."""

    vllm_importance_sampling_correction: bool = True
    """TRL's name and default: weigh each token's loss by the ratio of the training model's probability of the
    sampled completion to the engine's (truncated or masked, ``vllm_importance_sampling_mode``), correcting the
    mismatch between the two (kernels, precision). Logged: ``sampling/importance_sampling_ratio/{min,mean,max}``
    and ``sampling/sampling_logp_difference/{mean,max}``."""

    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    """TRL's modes: a ratio per token or one per completion (the product of its tokens' ratios), clipped to
    [clip_min, clip_max] (truncate) or set to 0 outside it (mask)."""

    vllm_importance_sampling_clip_min: HumanFloat | None = None
    """TRL's C_min (null: no lower bound)."""

    vllm_importance_sampling_clip_max: HumanFloat | None = 3.0
    """TRL's C_max and default (null: no upper bound)."""

    def batch_problems(self, global_batch: int, made_of: str) -> Iterator[Problem]:
        """A generated batch holds whole groups: the global batch (it counts completions) is a multiple of
        ``num_generations``."""
        group = self.num_generations
        if group >= 1 and global_batch % group:
            fit = -(-global_batch // group) * group
            yield Problem(
                "total_train_batch_size",
                f"the global batch counts completions: {global_batch} ({made_of}) is not a multiple of "
                f"num_generations={group}; set total_train_batch_size: {fit} (or micro_batch_size / "
                "gradient_accumulation_steps so that their product times the processes is a multiple)",
            )

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if not self.rewards and not self._environment_scores():
            yield Problem(
                "rewards",
                "empty: name at least one reward function (or an environment_factory whose class has get_reward)",
            )
        if self.num_generations < 2:
            yield Problem(
                "num_generations",
                f"{self.num_generations}: a group of one completion has no baseline (every advantage would be 0); "
                "use 2 or more (TRL's default is 8)",
            )
        if self.loss_type == "reinforce" and self.num_iterations > 1:
            yield Problem(
                "num_iterations",
                f"{self.num_iterations}: loss_type reinforce has no importance ratio, so updates on a batch "
                "generated by older weights would be biased; use 1, or a clipped loss_type (grpo, dapo, dr_grpo)",
            )
        if self.beta > 0 and self.ref_model is None and self.model.peft_pretrained:
            yield Problem(
                "ref_model",
                "beta > 0 with model.peft_pretrained: switching the adapters off would compare with the base model, "
                "not with the adapter training starts from; name that model as ref_model (a merged export), or "
                "set beta: 0",
            )
        if self.ref_model is not None and self.ref_model.peft_config is not None:
            yield Problem("ref_model.peft_config", "the reference model is frozen; adapters belong on model")
        yield from frozen_model_problems(self.ref_model, "ref_model")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if self.use_vllm and self.vllm_importance_sampling_correction:
            if low is None and high is None:
                yield Problem(
                    "vllm_importance_sampling_clip_max",
                    "null with vllm_importance_sampling_clip_min null: the correction needs a bound; set "
                    "vllm_importance_sampling_clip_max: 3.0 (TRL's default)",
                )
            elif low is not None and high is not None and low >= high:
                yield Problem(
                    "vllm_importance_sampling_clip_min",
                    f"{low} is not below vllm_importance_sampling_clip_max ({high}); lower it or raise the max",
                )

    @model_validator(mode="after")
    def _reward_columns(self) -> GRPOTrainerConfig:
        """The columns the built-in rewards read must be in every row: checked when the data is built."""
        if isinstance(self.data, GRPODataConfig):
            wanted = [r.column for r in self.rewards if isinstance(r, ExactMatchReward | CodeTestsReward)]
            self.data.reward_columns = list(dict.fromkeys([*self.data.reward_columns, *wanted]))
        return self

    def _environment_scores(self) -> bool:
        from posttrain.config.agents import scoring_environments

        try:
            return bool(scoring_environments(self.environment_factory))
        except ValueError:
            return False  # the environment's own error is reported

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0
