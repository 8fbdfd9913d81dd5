"""Online RL from rewards (``type: grpo``): GRPO and its relatives (DAPO, Dr. GRPO, RLOO, GSPO, REINFORCE).

grpo's own parts: its keys (``config/grpo.py``), its part of the online feed (``method.py``: advantages,
the old policy's and the reference's log-probabilities, the engine-mismatch correction) and the pure
objectives (``losses.py``). What every online method shares is elsewhere: the prompts (``data/prompts.py``),
the reward keys and functions (``config/rewards.py``, ``rewards/scorer.py``), generation and the step feed
(``rollout/``). This module holds what the trainer spec names: the steps, the loss, the schedule, the memory
plan's settings and the pre-flight report.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from posttrain.config.grpo import GRPOTrainerConfig
from posttrain.config.rewards import ModelReward
from posttrain.errors import UserError
from posttrain.methods.grpo.losses import loss_sum, sequence_shares, token_losses
from posttrain.methods.grpo.method import STATE_KEY, GRPOMethod, policy_loss
from posttrain.models.token_logps import token_logps
from posttrain.plan import BatchSizes
from posttrain.rewards.scorer import Scorer
from posttrain.rollout.agent import agent_report
from posttrain.rollout.ahead import ahead_lines
from posttrain.rollout.feed import OnlineSteps
from posttrain.rollout.sequence_split import COMPLETION_TOKENS
from posttrain.training.extras import COUNT

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.context import RunContext
    from posttrain.plan import Batches, DataPlan
    from posttrain.registry import MethodMemory
    from posttrain.training.engine import Engine


def grpo_steps(
    ctx: RunContext, engine: Engine, batches: Batches, tokenizer: PreTrainedTokenizerBase
) -> OnlineSteps:
    """grpo's ``steps`` hook (``registry.StepsBuilder``): the online feed's rollouts from the current weights,
    scored and turned into advantages by ``GRPOMethod``."""
    config = ctx.config
    method = GRPOMethod(ctx, engine, tokenizer)
    return OnlineSteps(
        ctx,
        engine,
        batches,
        tokenizer,
        method,
        group=config.num_generations,
        updates=config.num_iterations,
        state_key=STATE_KEY,
    )


def grpo_schedule(config: GRPOTrainerConfig, samples: int, sizes: BatchSizes) -> tuple[int, int]:
    """grpo's ``schedule`` hook (``registry.Schedule``). The step plan counts completions (the batch sizes
    do): P = global batch / num_generations prompts a batch, whole batches only (a global batch of whole
    groups is checked with the batch sizes, ``GRPOTrainerConfig.batch_problems``); each batch takes
    ``num_iterations`` optimizer steps."""
    group, batch = config.num_generations, sizes.global_batch_size
    prompts = batch // group
    if samples < prompts:
        raise UserError(
            f"{samples} prompts, fewer than the {prompts} a batch takes (global batch {batch} / num_generations "
            f"{group}); add prompts or lower the batch"
        )
    return samples // prompts * prompts * group, config.num_iterations


def grpo_memory(config: GRPOTrainerConfig) -> MethodMemory:
    """grpo's ``memory`` hook (``registry.MemoryHook``). What the memory plan adds for grpo: training rows of
    prompt + completion tokens, the generation's KV cache (a whole rank's completions at once), the reference
    model, vLLM's share, the reward models (their config key and path)."""
    return {
        "tokens_per_row_extra": config.max_completion_length,
        "generation_rows": True,
        "reference_model": config.beta > 0,
        "vllm_share": config.vllm_gpu_memory_utilization if config.use_vllm else 0.0,
        "reward_models": [
            (f"rewards[{index}].model", reward.model)
            for index, reward in enumerate(config.rewards)
            if isinstance(reward, ModelReward)
        ],
    }


def grpo_report(flight: DataPlan) -> list[str]:
    """grpo's ``report`` hook (``registry.ReportHook``). The pre-flight report's lines: prompts and
    completions per step, prompt lengths and truncation."""
    config, sizes, data = flight.config, flight.sizes, flight.data
    group = config.num_generations
    lengths = data.train.lengths("input_ids")
    report = data.train_report
    cut = f", {report.truncated} truncated to max_length" if report.truncated else ""
    limit = f"; max_prompt_length {config.data.max_prompt_length} ({config.data.prompt_truncation})"
    return [
        f"per generated batch: {sizes.global_batch_size // group} prompts x {group} completions (num_generations) "
        f"= {sizes.global_batch_size} completions of up to {config.max_completion_length} tokens, "
        f"{sizes.micro_batch_size * sizes.gradient_accumulation_steps} on each process; {config.num_iterations} "
        "optimizer step(s) per batch (num_iterations)",
        f"prompts: {len(lengths)}, {int(lengths.min())} to {int(lengths.max())} tokens (mean {lengths.mean():.1f})"
        + (limit if config.data.max_prompt_length else "")
        + cut,
        *ahead_lines(config, sizes.micro_batch_size * sizes.gradient_accumulation_steps),
        *agent_report(flight),
    ]


def extreme_clip_shares(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max``: of this micro-batch's completions on every
    process, the smallest share of low-clipped tokens and the largest of high-clipped ones (NaN-free
    completions only); each micro-batch counts once, so the step record is their mean over the step's
    micro-batches, as TRL averages what it appends per micro-batch. One collective per micro-batch (no host
    read) under data parallelism."""
    import torch.distributed as dist

    low = sequence_shares(stats["clip_ratio/low_mean"].detach(), mask)
    high = sequence_shares(stats["clip_ratio/high_mean"].detach(), mask)
    extremes = torch.stack(
        [torch.nan_to_num(low, nan=math.inf).min(), -torch.nan_to_num(high, nan=-math.inf).max()]
    ).double()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
    extremes = torch.where(torch.isinf(extremes), torch.full_like(extremes, math.nan), extremes)
    one = torch.ones((), dtype=torch.float64, device=extremes.device)  # every rank adds the same: a mean
    return {
        "clip_ratio/low_min": extremes[0],
        "clip_ratio/low_min" + COUNT: one,
        "clip_ratio/high_max": -extremes[1],
        "clip_ratio/high_max" + COUNT: one,
    }


class GRPOLoss:
    """The policy loss of a micro-batch of generated completions (``losses.py``), and for evaluation batches (prompts) the
    greedy completions' rewards: ``eval_reward`` (the weighted sum), ``eval_rewards/<name>``; ``eval_loss`` is
    the negated mean reward."""

    def __init__(self, config: GRPOTrainerConfig, feed: OnlineSteps, scorer: Scorer) -> None:
        self.config, self.feed, self.scorer = config, feed, scorer
        self.params = policy_loss(config)
        self.policy = feed.sampling.policy  # the sampler's distribution (models/sampling_policy.py)

    def __call__(self, model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if "prompt_ids" in batch:
            return self.evaluate(model, batch)
        config = self.config
        logps, entropy = token_logps(
            model, batch, config.tiled_loss_compute, config.temperature, entropy=True, policy=self.policy
        )
        mask = batch["completion_mask"]
        old = batch.get("old_logps")
        old = logps.detach() if old is None else old
        losses, stats = token_losses(
            self.params,
            logps,
            old,
            batch.get("ref_logps"),
            batch["advantages"],
            mask,
            batch.get("sampling_weight"),
        )
        tokens = mask.sum()
        completions = (mask.sum(-1) > 0).to(mask.dtype)  # completions with a token in the loss
        metrics = {}
        for name, values in stats.items():
            if values.shape[-1] == 1:  # one value per completion (GSPO's clip statistics): a mean over them
                metrics[name] = (values.detach()[:, 0] * completions).sum()
                metrics[name + COUNT] = completions.sum()
            else:
                metrics[name] = (values.detach() * mask).sum()
                metrics[name + COUNT] = tokens
        if "clip_ratio/low_mean" in stats:
            metrics.update(extreme_clip_shares(stats, mask))
        if entropy is not None:
            metrics["entropy"] = (entropy * mask).sum()
            metrics["entropy" + COUNT] = tokens
        return loss_sum(self.params, losses, mask, batch.get(COMPLETION_TOKENS)), metrics

    @torch.no_grad()
    def evaluate(self, model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rewards of greedy completions of the held-out prompts, generated as the run generates (its
        backend, vLLM too; its tools) and scored by the run's scorer (its reward workers)."""
        mask = batch["prompt_mask"].bool()
        prompts = [ids[keep].tolist() for ids, keep in zip(batch["prompt_ids"], mask, strict=True)]
        module = getattr(model, "module", model)
        feed = self.feed
        completions = feed.complete(module, batch["rows"], prompts, feed.sampling, None)
        weight = batch["prompt_weight"].double().cpu()
        metrics = self.scorer.evaluation(batch["rows"], completions, weight, feed.trainer_state)
        return -metrics["reward"], metrics


def make_grpo_loss(
    config: GRPOTrainerConfig, tokenizer: PreTrainedTokenizerBase, steps: OnlineSteps
) -> GRPOLoss:
    """grpo's ``loss`` hook (``registry.LossBuilder``): evaluates through the run's feed (``grpo_steps``)."""
    method = steps.method
    if not isinstance(method, GRPOMethod):
        raise TypeError(f"grpo's loss needs grpo's step feed, not {type(method).__name__}")
    return GRPOLoss(config, steps, method.scorer)
