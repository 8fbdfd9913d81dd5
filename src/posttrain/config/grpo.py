"""Config of the ``grpo`` trainer (online RL from rewards: GRPO, DAPO, Dr. GRPO, RLOO, GSPO).

The keys are named as in TRL's ``GRPOConfig`` (``num_generations``, ``beta``, ``epsilon``, ``epsilon_high``,
``num_iterations``, ``loss_type``, ``scale_rewards``...) so that a TRL user's settings carry over. The reward
keys every scored online method shares are ``config/rewards.py``'s, the generation and tool keys
``config/online.py``'s, the prompt data ``config/prompts.py``'s."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from posttrain.config.base import ModeKeys, Problem
from posttrain.config.fp8 import frozen_model_problems
from posttrain.config.human import HumanFloat, HumanInt
from posttrain.config.model import ModelConfig
from posttrain.config.rewards import ScoredConfig


def _scale(value: Any) -> Any:
    """TRL also takes booleans: true is ``group``, false is ``none``."""
    return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


class GRPOTrainerConfig(ScoredConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        *ScoredConfig.mode_keys,
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
            ("dynamic_filtering_range", "max_num_gen_batches"),
            lambda c, root: c.dynamic_sampling,
            "dynamic_sampling: true",
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

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (NeMo-RL's ``use_dynamic_sampling``, verl's ``filter_groups``): a group whose
    completions all have the same total reward (no signal) is dropped before the loss, and more prompts are
    generated, from the current weights in a fixed keyed order, until the batch is full again; the same
    batches for any process count or timing. See ``dynamic_filtering_range`` and ``max_num_gen_batches``."""

    dynamic_filtering_range: tuple[HumanFloat, HumanFloat] | None = None
    """OpenRLHF's name and meaning: with ``dynamic_sampling``, also drop a group whose mean total reward is
    not strictly inside ``[low, high]`` (a pass-rate range with 0/1 rewards: ``[0, 1]`` drops the groups all
    solved or all failed, a tighter one the nearly so). Null: only the groups without spread."""

    max_num_gen_batches: HumanInt = Field(default=8, ge=1)
    """verl's name and meaning: with ``dynamic_sampling``, the most generation rounds a step's batch may take,
    the first included. When they are spent the batch's places still empty keep filtered groups, out of the
    loss (said once a run, counted in ``dynamic_sampling/masked_groups``)."""

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
        yield from self._dynamic_sampling_problems()
        if self.generates_ahead and not self.vllm_importance_sampling_correction:
            key = "max_staleness" if self.max_staleness else "weight_sync_steps"
            yield Problem(
                "vllm_importance_sampling_correction",
                f"false with {key}: {getattr(self, key)}: batches generated from older weights are off-policy, "
                "and the engine's log-probabilities are their behaviour policy only through the correction; "
                "set it to true",
            )
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

    def _dynamic_sampling_problems(self) -> Iterator[Problem]:
        if self.dynamic_filtering_range is not None:
            low, high = self.dynamic_filtering_range
            if low >= high:
                yield Problem(
                    "dynamic_filtering_range",
                    f"[{low}, {high}]: the low end is not below the high end; groups are kept when their mean "
                    "reward is strictly between the two, e.g. [0, 1] for 0/1 rewards",
                )
        if self.dynamic_sampling and (self.agentic or self.rollout_func or self.agent_function):
            yield Problem(
                "dynamic_sampling",
                "true with multi-turn rollouts (tools, environment_factory, rollout_func, agent_function): refilled "
                "batches of multi-turn completions are not supported yet; use dynamic_sampling: false there",
            )

    def sequence_parallel_problems(self) -> Iterator[Problem]:
        """What needs a whole completion's sum inside the loss is not split over the group yet."""
        sp = self.sequence_parallel_size
        if self.importance_sampling_level == "sequence":
            yield Problem(
                "importance_sampling_level",
                f"sequence (GSPO) with sequence_parallel_size={sp}: one ratio per completion would need the "
                "completion's tokens from every process of the group, not done yet; use token, or "
                "sequence_parallel_size: 1",
            )
        yield from super().sequence_parallel_problems()

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0
