"""GRPO-family objectives as pure functions of log-probabilities, advantages and masks.

Notation: for completion i of a group of G with reward r_i, tokens t with mask m_it (1 on completion tokens
that count), policy log-probability l_it = log pi(o_it | q, o_i<t) at the sampling temperature, the old
policy's (the one that generated the batch) l^old_it and the reference's l^ref_it.

Advantages (``advantages``), as TRL 1.16 computes them:
- grpo (DeepSeekMath, Shao et al. 2024): A_i = r_i - mean_j r_j over the group;
- rloo (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_j r_j), the
  leave-one-out baseline of TRL's RLOOTrainer, inside GRPO's loss (TRL's RLOOTrainer is this with
  ``scale_rewards: none``, its KL as a sequence-level reward penalty rather than the k3 term per token);
then divided by std + 1e-4 of the group's rewards (``scale_rewards: group``, as DeepSeekMath), of the whole
step's rewards (``batch``), or not at all (``none``: Dr. GRPO, Liu et al. 2025). Standard deviations are
unbiased (n - 1), as TRL takes them (``nanstd``). A completion no reward function scored (every one returned
None) has reward NaN: it is left out of its group's mean and spread (and out of the leave-one-out baseline)
and its advantage is 0; a group with one scored completion has no spread, and advantages 0.

Per-token loss (``token_losses``), with the ratio rho_it = exp(l_it - l^old_it) per token (``token``), or
exp(sum_t m_it (l_it - l^old_it) / sum_t m_it) for the whole completion (``sequence``: GSPO, Zheng et al.
2025), and clipping bounds [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher, Yu et al. 2025):

    L_it = -min(rho_it A_i, clip(rho_it, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_it

and for ``reinforce`` (no ratio): L_it = -A_i l_it + beta KL_it. KL_it is the k3 estimator of
KL(pi || pi_ref) (Schulman 2020): exp(l^ref - l) - (l^ref - l) - 1, which is >= 0 and unbiased; with TRL's
``use_bias_correction_kl`` (its default) it is multiplied by the unclipped ratio rho_it (DeepSeek-V3.2), whose
gradient reaches it even on-policy, where rho is 1: the unbiased reverse-KL gradient.

Aggregation (``loss_sum``) returns a *sum*; posttrain's loop divides by the loss units of the whole optimizer
step over every micro-batch and rank, so each form is exact under gradient accumulation and data parallelism:
- grpo (and reinforce): sum_i (sum_t m_it L_it / sum_t m_it); units: completions;
- dapo: sum_i sum_t m_it L_it; units: completion tokens (m summed);
- dr_grpo: sum_i sum_t m_it L_it / max_completion_length; units: completions.
On-policy (one update per batch, l^old = l detached) the ratio is 1 and its gradient is that of
-A_i l_it: the REINFORCE gradient with the group baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

STD_EPSILON = 1e-4


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased (n - 1) standard deviation of the values that are not NaN; NaN with fewer than two (TRL's
    ``nanstd``)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True).to(values.dtype)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = (variance * correction).sqrt()
    return std if keepdim else (std.squeeze(dim) if dim is not None else std.reshape(()))


def reward_spread(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Per completion, the standard deviation its advantage is scaled by (or, for ``none``, would be): its
    group's, or the whole step's for ``batch``."""
    if scale == "batch":
        return nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)


def advantages(rewards: torch.Tensor, group: int, baseline: str, scale: str) -> torch.Tensor:
    """``rewards``: the step's completions in group order (``[prompts x group]`` flattened), NaN for one no
    reward function scored (its advantage is 0)."""
    grouped = rewards.view(-1, group)
    if baseline == "rloo":
        scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
        centred = grouped - others
    else:
        centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    centred = centred.reshape(-1)
    if scale != "none":
        centred = centred / (reward_spread(rewards, group, scale) + STD_EPSILON)
    return torch.nan_to_num(centred, nan=0.0)


@dataclass(frozen=True)
class PolicyLoss:
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    sequence_ratio: bool = False  # GSPO's one ratio per completion
    max_completion_length: int = 256
    bias_correction_kl: bool = True  # the KL term times the (unclipped) ratio: TRL's use_bias_correction_kl


@dataclass(frozen=True)
class SamplingCorrection:
    """TRL's ``vllm_importance_sampling_correction``: the engine's and the trainer's probabilities of a sampled
    completion differ (kernels, precision, batch shapes), so each token's loss is weighed by
    w = pi_train / pi_engine, per token or once per completion (the product over its tokens), then clipped to
    [low, high] (``*_truncate``) or set to 0 outside it (``*_mask``)."""

    mode: str = "sequence_mask"
    low: float | None = None
    high: float | None = 3.0

    @property
    def sequence(self) -> bool:
        return self.mode.startswith("sequence")


def sampling_weights(
    params: SamplingCorrection,
    old: torch.Tensor,
    sampling: torch.Tensor,
    mask: torch.Tensor,
    whole: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The correction's weights: ``[completions, tokens]``, or ``[completions, 1]`` per completion, from the
    trainer's log-probabilities when the batch was generated (``old``) and the engine's (``sampling``, NaN
    where it gave none: such a token weighs 1). ``whole``: each completion's sum over its whole sequence from
    this process's part of it (sequence parallelism: the sum over the group's slices)."""
    delta = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if params.sequence:
        delta = delta.sum(-1, keepdim=True)
        if whole is not None:
            delta = whole(delta)
    ratio = torch.exp(delta)
    if params.mode.endswith("truncate"):
        return torch.clamp(ratio, min=params.low, max=params.high)
    low = -math.inf if params.low is None else params.low
    high = math.inf if params.high is None else params.high
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampling_statistics(
    params: SamplingCorrection,
    old: torch.Tensor,
    sampling: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """One process's ``[mean |old - sampling|, its max, min weight, mean weight, max weight]`` over its
    completion tokens (tokens the engine gave no log-probability left out; per completion for a sequence
    mode), 0 where there is nothing, as TRL computes them before gathering."""
    delta = (old - sampling).abs()[mask.bool() & ~torch.isnan(sampling)]
    flat = weights.flatten() if params.sequence else weights[mask.bool()]
    zero = torch.zeros((), dtype=torch.float64)
    return torch.stack(
        [
            delta.double().mean() if delta.numel() else zero,
            delta.double().max() if delta.numel() else zero,
            flat.double().min() if flat.numel() else zero,
            flat.double().mean() if flat.numel() else zero,
            flat.double().max() if flat.numel() else zero,
        ]
    )


def sampling_records(gathered: torch.Tensor) -> dict[str, float]:
    """TRL's ``sampling/...`` metrics from every process's :func:`sampling_statistics` (``[processes, 5]``):
    the mean of the means, the largest max, the smallest min."""
    return {
        "sampling/sampling_logp_difference/mean": float(gathered[:, 0].mean()),
        "sampling/sampling_logp_difference/max": float(gathered[:, 1].max()),
        "sampling/importance_sampling_ratio/min": float(gathered[:, 2].min()),
        "sampling/importance_sampling_ratio/mean": float(gathered[:, 3].mean()),
        "sampling/importance_sampling_ratio/max": float(gathered[:, 4].max()),
    }


#: the mean |engine - trainer| log-probability per sampled token that a dtype's rounding explains at most
#: (float32: measured near 1e-6 on vLLM's CPU build; 16-bit: TRL's runs report 1e-2 and below)
EXPLAINED_LOGP_GAP = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def engine_mismatch(records: dict[str, float], dtype: str) -> str:
    """A line when the engine's log-probabilities of its own samples part from the trainer's by far more than
    ``dtype`` explains (the engine does not sample from the trained weights); "" otherwise."""
    gap = records.get("sampling/sampling_logp_difference/mean", 0.0)
    explained = EXPLAINED_LOGP_GAP.get(dtype, 0.1)
    if not gap > explained:
        return ""
    return (
        f"the vLLM engine's log-probabilities of its samples differ from the trainer's by {gap:.3g} nats a token "
        f"on average (max {records.get('sampling/sampling_logp_difference/max', 0.0):.3g}), far above what "
        f"{dtype} explains (about {explained:g} at most): the engine is not sampling from the trained weights, "
        "and the importance-sampling correction would mask or truncate most of the batch. Check the weight "
        "push (vLLM's model class for this architecture, its parameter names), or set use_vllm: false"
    )


def log_ratio(logps: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, sequence: bool) -> torch.Tensor:
    """l - l_old per token ``[completions, tokens]``, or (``sequence``) the completion's mean over its tokens,
    ``[completions, 1]`` (broadcast where it meets the tokens, as TRL keeps it)."""
    delta = logps - old
    if not sequence:
        return delta
    return (delta * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def k3(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token."""
    delta = ref - logps
    return torch.exp(delta) - delta - 1


def token_losses(
    params: PolicyLoss,
    logps: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    sampling_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``[completions, tokens]`` losses and the statistics (KL, the clipped share): per token, ``[completions,
    tokens]`` (to be averaged over the mask), or, for a ratio per completion (GSPO), the clip statistics per
    completion, ``[completions, 1]`` (averaged over the completions, as TRL does). ``sampling_weight``: the
    engine-mismatch correction (:func:`sampling_weights`), applied to the policy term, not to the KL, as TRL
    applies it."""
    adv = advantage.unsqueeze(-1)
    stats: dict[str, torch.Tensor] = {}
    ratio = torch.exp(log_ratio(logps, old, mask, params.sequence_ratio))
    if params.loss_type == "reinforce":
        loss = -adv * logps
    else:
        clipped = torch.clamp(ratio, 1 - params.epsilon, 1 + params.epsilon_high)
        loss = -torch.min(ratio * adv, clipped * adv)
        low = (ratio < 1 - params.epsilon) & (adv < 0)
        high = (ratio > 1 + params.epsilon_high) & (adv > 0)
        stats["clip_ratio/low_mean"] = low.float()
        stats["clip_ratio/high_mean"] = high.float()
        stats["clip_ratio/region_mean"] = (low | high).float()
    if sampling_weight is not None:
        loss = loss * sampling_weight
    if params.beta > 0 and ref is not None:
        kl = k3(logps, ref)
        if params.bias_correction_kl:
            kl = kl * ratio  # TRL's use_bias_correction_kl: the unbiased reverse-KL gradient
        loss = loss + params.beta * kl
        stats["kl"] = kl
    return loss.expand_as(logps), stats


def sequence_shares(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's mean of a per-token statistic over its tokens (a per-completion one as it is); NaN
    for a completion with no token in the loss (TRL's ``masked_seq_mean``)."""
    if values.shape[-1] == 1:
        return values[:, 0]
    return (values * mask).sum(-1) / mask.sum(-1)


def loss_sum(
    params: PolicyLoss, losses: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """The micro-batch's share of the step loss, as a sum over its completions (see the module docstring).
    ``lengths``: each completion's tokens in the loss when ``mask`` holds a slice of them (sequence
    parallelism), else the mask's."""
    masked = (losses * mask).sum(-1)
    if params.loss_type in ("grpo", "reinforce"):
        counts = mask.sum(-1) if lengths is None else lengths.to(mask.dtype)
        return (masked / counts.clamp(min=1.0)).sum()
    if params.loss_type == "dr_grpo":
        return masked.sum() / params.max_completion_length
    return masked.sum()  # dapo


def loss_units(params: PolicyLoss, mask: torch.Tensor, completions: int | None = None) -> int:
    """What the loop divides the step's summed loss by: completion tokens (dapo) or completions (the mask's
    rows, or ``completions``: a sequence-parallel slice's, counted by the group's first process only)."""
    if params.loss_type == "dapo":
        return int(mask.sum())
    return int(mask.shape[0]) if completions is None else completions
