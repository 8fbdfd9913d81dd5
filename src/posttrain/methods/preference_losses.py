"""DPO-family losses as pure functions of summed log-probabilities (one value per pair).

Inputs: ``policy_chosen``/``policy_rejected`` — summed log-probs of the answer tokens under the policy;
``ref_chosen``/``ref_rejected`` — the same under the frozen reference (zeros when reference-free);
``chosen_len``/``rejected_len`` — answer token counts (for the length-normalised losses).
Each returns ``(loss, chosen_reward, rejected_reward)`` per pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


@dataclass(frozen=True)
class PreferenceParams:
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


def preference_loss(
    params: PreferenceParams,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    beta, smoothing = params.beta, params.label_smoothing
    if params.loss_type in ("sigmoid", "ipo", "hinge"):
        chosen_reward = beta * (policy_chosen - ref_chosen)
        rejected_reward = beta * (policy_rejected - ref_rejected)
        h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
        if params.loss_type == "sigmoid":
            # DPO; with label smoothing, the conservative DPO of Mitchell (2023)
            loss = -(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
        elif params.loss_type == "ipo":
            loss = (h - 1 / (2 * beta)) ** 2  # IPO (Azar et al. 2023)
        else:
            loss = torch.relu(1 - beta * h)  # SLiC hinge
        return loss, chosen_reward, rejected_reward
    chosen_mean = policy_chosen / chosen_len.clamp(min=1)
    rejected_mean = policy_rejected / rejected_len.clamp(min=1)
    if params.loss_type == "simpo":
        # SimPO (Meng et al. 2024): length-normalised, reference-free, with a target margin gamma
        logits = beta * (chosen_mean - rejected_mean) - params.simpo_gamma
        loss = -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
        return loss, beta * chosen_mean, beta * rejected_mean
    if params.loss_type == "orpo":
        # ORPO (Hong et al. 2024): NLL of the chosen answer + beta * odds-ratio loss, from mean token log-probs
        log_odds = (chosen_mean - rejected_mean) - (
            torch.log1p(-torch.exp(chosen_mean).clamp(max=1 - 1e-6))
            - torch.log1p(-torch.exp(rejected_mean).clamp(max=1 - 1e-6))
        )
        loss = -chosen_mean - beta * F.logsigmoid(log_odds)
        return loss, beta * chosen_mean, beta * rejected_mean
    raise ValueError(f"unknown loss_type {params.loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")
