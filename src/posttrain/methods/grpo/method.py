"""grpo's part of the online feed (``rollout.feed.OnlineSteps``): each generated batch's rewards (gathered from
every rank: a group may straddle ranks), advantages and records, the old policy's, the reference's and the
engine-mismatch correction's values for the loss, and the completions log's reward fields. What every online
method shares (prompt order, slots, backends, keyed draws, resume between updates) is the feed's."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.context import RunContext
from posttrain.dist import all_gather_rows
from posttrain.logs import say
from posttrain.methods.grpo.dynamic_sampling import DynamicSampling
from posttrain.methods.grpo.losses import (
    PolicyLoss,
    SamplingCorrection,
    advantages,
    engine_mismatch,
    loss_units,
    nanstd,
    reward_spread,
    sampling_records,
    sampling_statistics,
    sampling_weights,
)
from posttrain.models.reference import Reference
from posttrain.models.sampling_policy import policy_of
from posttrain.models.token_logps import token_logps
from posttrain.rewards.scorer import Scorer, Scores
from posttrain.rollout.feed import (
    IN_LOSS,
    GeneratedBatch,
    GenerationStats,
    OnlineMethod,
    OnlineSteps,
    completion_records,
)
from posttrain.rollout.sequence_split import whole_sequence_sums

STATE_KEY = "grpo"


class GRPOMethod(OnlineMethod):
    """grpo's ``OnlineMethod``: see the module docstring."""

    def __init__(self, ctx: RunContext, engine: Any, tokenizer: Any) -> None:
        config = ctx.config
        self.ctx, self.engine, self.config = ctx, engine, config
        self.scorer = Scorer(config, tokenizer)
        self.reference = (
            Reference(config.model, config.ref_model, ctx, engine, tokenizer) if config.beta > 0 else None
        )
        self.params = policy_loss(config)
        self.policy = policy_of(
            config, tokenizer
        )  # the sampler's distribution: every log-probability is from it
        self.correction = sampling_correction_of(config)
        self.whole = whole_sequence_sums(config)  # a completion's sum over its slices (sequence parallelism)
        self.wants_sampling_logps = self.correction is not None
        self.mask_truncated = config.mask_truncated_completions
        self.updates = config.num_iterations
        self.mismatch_said = False  # the engine-mismatch line, once a run
        self.scores = Scores(torch.zeros(0, 0), {}, {}, [])
        self.totals = torch.zeros(0)
        self.advantage = torch.zeros(0)
        self.dynamic = DynamicSampling(config, len(self.scorer.names)) if config.dynamic_sampling else None

    def close(self) -> None:
        self.scorer.close()

    def describe(self) -> str:
        return f"grpo: rewards {self.scorer.describe()}"

    def after_generation(self, feed: OnlineSteps, generated: GeneratedBatch) -> GenerationStats:
        """Rewards of this rank's completions, gathered with every rank's into the batch's advantages and
        records (the same on every rank); this rank's advantages and loss units for the micro-batches."""
        dist, group = self.ctx.dist, feed.group
        out: dict[str, torch.Tensor] = {}
        if self.dynamic is not None:  # DAPO's filter and refill: the batch may change (dynamic_sampling.py)
            filled = self.dynamic.fill(feed, generated, lambda g: self._score(feed, g), self.scorer.total)
            self.scores, everyone, generated_tokens = filled.scores, filled.everyone, filled.generated_tokens
            out[IN_LOSS] = filled.in_loss[generated.first : generated.first + len(generated.slots)]
        else:
            self.scores, everyone = self._score(feed, generated)
            generated_tokens = float(everyone[:, -3].sum() + everyone[:, -2].sum())
        rewards = everyone[:, : len(self.scorer.names)]
        totals = self.scorer.total(rewards)
        advantage = advantages(totals, group, self.config.advantage, self.config.scale_rewards)
        every_length, every_cut, scale = everyone[:, -2], everyone[:, -1], self.config.scale_rewards
        latest = batch_records(rewards, totals, every_length, every_cut, self.scorer.names, group, scale)
        latest.update(self.scorer.step_records(self.scores, dist))
        # TRL's num_tokens: prompt and completion tokens of every generated batch so far, all ranks
        seen = feed.counters.get("num_tokens", 0.0) + generated_tokens
        feed.counters["num_tokens"] = seen
        latest["num_tokens"] = seen
        if self.dynamic is not None:
            latest.update(filled.records)
        own = slice(generated.first, generated.first + len(generated.slots))
        self.totals, self.advantage = totals[own], advantage[own]
        return GenerationStats({"advantages": self.advantage.float(), **out}, latest)

    def _score(self, feed: OnlineSteps, generated: GeneratedBatch) -> tuple[Scores, torch.Tensor]:
        """This rank's rewards of a generated batch, and every rank's rewards, prompt and completion lengths
        and truncation gathered (``[batch completions, rewards + 3]``, slot order: a collective)."""
        scores = self.scorer.score(generated.rows, generated.completions, feed.trainer_state)
        completions = generated.completions
        lengths = torch.tensor(completions.model_lengths(), dtype=torch.float64)
        truncated = torch.tensor(completions.truncated, dtype=torch.float64)
        prompted = torch.tensor([len(p) for p in generated.prompt_ids], dtype=torch.float64)
        mine = torch.cat([scores.values, prompted[:, None], lengths[:, None], truncated[:, None]], dim=1)
        return scores, all_gather_rows(mine, self.ctx.dist)

    def finish_batches(
        self, feed: OnlineSteps, generated: GeneratedBatch, micro_batches: list[dict[str, Any]]
    ) -> dict[str, Any]:
        for batch in micro_batches:
            batch["num_loss_units"] = loss_units(self.params, batch["completion_mask"], batch["num_samples"])
        statistics = self._add_log_probabilities(micro_batches)
        if statistics is None:
            return {}
        records = sampling_records(all_gather_rows(statistics[None], self.ctx.dist))
        # generated ahead (staleness > 0): off-policy, the mismatch is not the engine's alone
        line = engine_mismatch(records, self.config.model.dtype) if not generated.staleness else ""
        if line and not self.mismatch_said:
            say(line)
            self.mismatch_said = True
        return records

    def log_fields(self, feed: OnlineSteps, generated: GeneratedBatch, index: int) -> dict[str, Any]:
        """The completion's total reward, its advantage, and the scorer's fields (each function's value, the
        columns the functions added)."""
        return {
            "reward": float(self.totals[index]),
            "advantage": float(self.advantage[index]),
            **self.scorer.completion_fields(self.scores, index),
        }

    @torch.no_grad()
    def _add_log_probabilities(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor | None:
        """The old policy's log-probabilities (for the ratio of later updates, and always under the
        engine-mismatch correction, as TRL), the reference's, and the correction's weights; returns this
        rank's correction statistics (``losses.sampling_statistics``) when it applies."""
        correction = self.correction
        if self.updates == 1 and self.reference is None and correction is None:
            return None
        from posttrain.data.collate import to_device

        tiled, temperature = self.config.tiled_loss_compute, self.config.temperature
        olds, samplings, masks = [], [], []
        for batch in micro_batches:
            sampling = batch.pop("sampling_logps", None)
            on_device = to_device(batch, self.engine.device)
            if self.updates > 1 or correction is not None:
                batch["old_logps"] = token_logps(
                    self.engine, on_device, tiled, temperature, policy=self.policy
                )[0].cpu()
            if self.reference is not None:
                batch["ref_logps"] = self.reference.logps(on_device, temperature, self.policy, tiled).cpu()
            if correction is not None and sampling is not None:
                mask = batch["completion_mask"]
                batch["sampling_weight"] = sampling_weights(
                    correction, batch["old_logps"], sampling, mask, self.whole
                )
                olds.append(batch["old_logps"].flatten())
                samplings.append(sampling.flatten())
                masks.append(mask.flatten())
        if correction is None or not olds:
            return None
        weights = torch.cat([b["sampling_weight"].flatten() for b in micro_batches if "sampling_weight" in b])
        old, sampled, mask = (torch.cat(parts).view(1, -1) for parts in (olds, samplings, masks))
        return sampling_statistics(correction, old, sampled, mask, weights.view(1, -1))


def sampling_correction_of(config: Any) -> SamplingCorrection | None:
    """TRL's vLLM importance-sampling correction, when the run generates with vLLM and keeps it on."""
    if not (config.use_vllm and config.vllm_importance_sampling_correction):
        return None
    return SamplingCorrection(
        config.vllm_importance_sampling_mode,
        config.vllm_importance_sampling_clip_min,
        config.vllm_importance_sampling_clip_max,
    )


def policy_loss(config: Any) -> PolicyLoss:
    return PolicyLoss(
        loss_type=config.loss_type,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.clip_high,
        sequence_ratio=config.importance_sampling_level == "sequence",
        max_completion_length=config.max_completion_length,
        bias_correction_kl=config.use_bias_correction_kl,
    )


def batch_records(
    rewards: torch.Tensor,
    totals: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    names: list[str],
    group: int,
    scale: str,
) -> dict[str, float]:
    """A generated batch's records, as TRL 1.16 logs them, from every rank's completions (``rewards``: ``[completions,
    functions]``, NaN where a function returned None; ``totals``: their weighted sums, NaN where none scored):
    ``reward`` and ``reward_std`` over the scored completions of the whole batch, ``frac_reward_zero_std`` over
    completions from the spread their advantage is scaled by, the lengths of all and of the terminated
    completions (0 when none ended), each function's mean and std over the completions it scored;
    ``reward_std_group``: the mean of the groups' standard deviations (what ``reward_std`` meant in older
    TRL)."""
    spread = reward_spread(totals, group, scale)
    out = {
        "reward": float(torch.nanmean(totals)),
        "reward_std": float(nanstd(totals)),
        "reward_std_group": float(torch.nanmean(nanstd(totals.view(-1, group), dim=1))),
        "frac_reward_zero_std": float(torch.isclose(spread, torch.zeros_like(spread)).double().mean()),
        **completion_records(lengths, truncated),
    }
    for index, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(torch.nanmean(rewards[:, index]))
        out[f"rewards/{name}/std"] = float(nanstd(rewards[:, index]))
    return out
