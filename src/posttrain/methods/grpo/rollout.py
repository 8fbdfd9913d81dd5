"""grpo's part of the online feed (``rollout.feed.OnlineSteps``): each generated batch's rewards (gathered from
every rank: a group may straddle ranks), advantages and records, the old policy's, the reference's and the
engine-mismatch correction's values for the loss, and the completions log's reward fields. What every online
method shares (prompt order, slots, backends, keyed draws, resume between updates) is the feed's."""

from __future__ import annotations

import math
from typing import Any

import torch

from posttrain.context import RunContext
from posttrain.dist import all_gather_rows, all_reduce_sum
from posttrain.logs import say
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
from posttrain.models.token_logps import token_logps
from posttrain.rollout.feed import OnlineSteps, Rollout, completion_records
from posttrain.rollout.rewards import Scorer

STATE_KEY = "grpo"
#: the fields of a completions.jsonl line a reward's ``log_extra`` column must not take (it is prefixed)
LOG_FIELDS = (
    "generation",
    "epoch",
    "batch",
    "prompt",
    "completion",
    "truncated",
    "reward",
    "rewards",
    "advantage",
    "origin",
)


class Reference:
    """The frozen model the KL penalty compares with: the base model with the adapters off (PEFT), or a
    separate frozen copy (``ref_model``, or the policy's initial weights)."""

    def __init__(self, config: Any, ctx: RunContext, engine: Any, tokenizer: Any) -> None:
        self.engine, self.model = engine, None
        module = engine.module
        if config.ref_model is None and hasattr(module, "disable_adapter"):
            return
        from posttrain.models.embeddings import fit_embeddings
        from posttrain.models.reference import load_reference_model

        reference = load_reference_model(config.ref_model or config.model, ctx)
        fit_embeddings(reference, tokenizer)
        self.model = reference.to(engine.device)

    @torch.no_grad()
    def logps(self, batch: dict[str, Any], temperature: float) -> torch.Tensor:
        if self.model is not None:
            return token_logps(self.model, batch, False, temperature)[0]
        with self.engine.module.disable_adapter():
            return token_logps(self.engine, batch, False, temperature)[0]


class GRPORollout:
    """grpo's ``OnlineMethod``: see the module docstring."""

    def __init__(self, ctx: RunContext, engine: Any, tokenizer: Any) -> None:
        config = ctx.config
        self.ctx, self.engine, self.config = ctx, engine, config
        self.scorer = Scorer(config, tokenizer)
        self.reference = Reference(config, ctx, engine, tokenizer) if config.beta > 0 else None
        self.params = policy_loss(config)
        self.correction = sampling_correction_of(config)
        self.wants_sampling_logps = self.correction is not None
        self.updates = config.num_iterations
        self.mismatch_said = False  # the engine-mismatch line, once a run
        self.none_said = False  # the line for completions no reward scored, once a run
        self.extra: dict[str, list[Any]] = {}
        self.values = torch.zeros(0, 0)
        self.totals = torch.zeros(0)
        self.advantage = torch.zeros(0)

    def close(self) -> None:
        self.scorer.guard.close()

    def describe(self) -> str:
        names = ", ".join(f"{r.name} x {r.weight:g}" for r in self.scorer.rewards)
        return f"grpo: rewards {names}"

    def after_generation(self, feed: OnlineSteps, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Rewards of this rank's completions, gathered with every rank's into the batch's advantages and
        records (the same on every rank); this rank's advantages and loss units for the micro-batches."""
        dist, group, completions = self.ctx.dist, feed.group, rollout.completions
        self.scorer.context.trainer_state = feed.trainer_state
        values = self.scorer(rollout.rows, completions)
        self.extra, logged = self.scorer.context.take()
        lengths = torch.tensor(completions.model_lengths(), dtype=torch.float64)
        truncated = torch.tensor(completions.truncated, dtype=torch.float64)
        prompted = torch.tensor([len(p) for p in rollout.prompt_ids], dtype=torch.float64)
        mine = torch.cat([values, prompted[:, None], lengths[:, None], truncated[:, None]], dim=1)
        everyone = all_gather_rows(mine, dist)  # [batch completions, rewards + 3], slot order
        rewards = everyone[:, : values.shape[1]]
        totals = self.scorer.total(rewards)
        advantage = advantages(totals, group, self.config.advantage, self.config.scale_rewards)
        names = [reward.name for reward in self.scorer.rewards]
        every_length, every_cut, scale = everyone[:, -2], everyone[:, -1], self.config.scale_rewards
        latest = rollout_records(rewards, totals, every_length, every_cut, names, group, scale)
        latest.update(self._logged_metrics(logged))
        latest.update(self.scorer.failure_records(dist))
        none_line = self.scorer.all_none_line(dist)
        if none_line and not self.none_said:
            say(none_line)
            self.none_said = True
        # TRL's num_tokens: prompt and completion tokens of every generated batch so far, all ranks
        seen = feed.counters.get("num_tokens", 0.0) + float(everyone[:, -3].sum() + everyone[:, -2].sum())
        feed.counters["num_tokens"] = seen
        latest["num_tokens"] = seen
        feed.metrics.latest = latest
        own = slice(rollout.first, rollout.first + len(rollout.slots))
        self.values, self.totals, self.advantage = values, totals[own], advantage[own]
        return {"advantages": self.advantage.float()}

    def finish_batches(
        self, feed: OnlineSteps, rollout: Rollout, micro_batches: list[dict[str, Any]]
    ) -> None:
        for batch in micro_batches:
            batch["num_loss_units"] = loss_units(self.params, batch["completion_mask"])
        statistics = self._add_log_probabilities(micro_batches)
        if statistics is not None:
            records = sampling_records(all_gather_rows(statistics[None], self.ctx.dist))
            feed.metrics.latest.update(records)
            line = engine_mismatch(records, self.config.model.dtype)
            if line and not self.mismatch_said:
                say(line)
                self.mismatch_said = True

    def log_fields(self, feed: OnlineSteps, rollout: Rollout, index: int) -> dict[str, Any]:
        """The completion's total reward, each function's, its advantage and the columns the rewards added
        (``log_extra``, one value per completion; prefixed ``extra/`` where they would take a built-in
        field's name)."""
        names = [r.name for r in self.scorer.rewards]
        fields: dict[str, Any] = {
            "reward": float(self.totals[index]),
            "rewards": {n: _plain(float(self.values[index, i])) for i, n in enumerate(names)},
            "advantage": float(self.advantage[index]),
        }
        for column, logged in self.extra.items():
            key = column if column not in LOG_FIELDS else f"extra/{column}"
            fields[key] = _json_value(logged[index]) if index < len(logged) else None
        return fields

    def _logged_metrics(self, logged: dict[str, list[float]]) -> dict[str, float]:
        """The rewards' ``log_metric`` values: each name's mean over every call on every rank (names gathered
        from all ranks, so that a name logged on one rank only still reduces)."""
        dist = self.ctx.dist
        names = set(logged)
        if dist.world_size > 1:
            import torch.distributed as torch_dist

            everyone: list[Any] = [None] * dist.world_size
            torch_dist.all_gather_object(everyone, sorted(names))
            names = {name for found in everyone for name in found}
        names_in_order = sorted(names)
        local = [x for n in names_in_order for x in (sum(logged.get(n, [])), float(len(logged.get(n, []))))]
        totals = all_reduce_sum(local, dist) if local else []
        return {
            name: totals[2 * i] / totals[2 * i + 1] if totals[2 * i + 1] else math.nan
            for i, name in enumerate(names_in_order)
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
                batch["old_logps"] = token_logps(self.engine, on_device, tiled, temperature)[0].cpu()
            if self.reference is not None:
                batch["ref_logps"] = self.reference.logps(on_device, temperature).cpu()
            if correction is not None and sampling is not None:
                mask = batch["completion_mask"]
                batch["sampling_weight"] = sampling_weights(correction, batch["old_logps"], sampling, mask)
                olds.append(batch["old_logps"].flatten())
                samplings.append(sampling.flatten())
                masks.append(mask.flatten())
        if correction is None or not olds:
            return None
        weights = torch.cat([b["sampling_weight"].flatten() for b in micro_batches if "sampling_weight" in b])
        old, sampled, mask = (torch.cat(parts).view(1, -1) for parts in (olds, samplings, masks))
        return sampling_statistics(correction, old, sampled, mask, weights.view(1, -1))


def _plain(value: float) -> float | None:
    return None if math.isnan(value) else value


def _json_value(value: Any) -> Any:
    """A value a reward logged, as JSON holds it: numbers (NaN as null), text, bools, lists; others as text."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float):
        return _plain(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return str(value)


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


def rollout_records(
    rewards: torch.Tensor,
    totals: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    names: list[str],
    group: int,
    scale: str,
) -> dict[str, float]:
    """A rollout's records, as TRL 1.16 logs them, from every rank's completions (``rewards``: ``[completions,
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
