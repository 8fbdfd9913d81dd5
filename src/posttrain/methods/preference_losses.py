"""DPO-family losses as pure functions of each pair's log-probabilities.

Every loss reads a ``Pairs`` (one value per pair): ``policy_chosen``/``policy_rejected`` — the answer's
summed token log-probs under the policy; ``ref_chosen``/``ref_rejected`` — the same under the frozen reference
(zeros when reference-free); ``chosen_len``/``rejected_len`` — the answer's token counts; ``weight`` — 1 for a
pair, 0 for an eval shard's padding pair; ``score_delta`` — the data's score of the chosen answer minus the
rejected one's (NaN when the row has none). Each returns one loss per pair; a term defined on the batch
(``sft``'s token mean, ``kto_pair``'s KL estimates, ``aot``'s sorting) is computed over the pairs of the
micro-batch with weight 1, as both sources compute it over theirs.

Notation in the docstrings: ``lc = policy_chosen - ref_chosen``, ``lr = policy_rejected - ref_rejected``,
``h = lc - lr``, ``mc``/``mr`` the per-token means of the policy log-probs, ``b`` = beta,
``e`` = label_smoothing, ``ls(x)`` = log sigmoid(x), ``s(x)`` = sigmoid(x). Sources: ERNIEKit
(``ernie/loss/dpo.py``) and TRL 1.16 (``DPOTrainer``); where both define a name, ERNIEKit's (the seed's)
definition is the one here and the reference docs say where TRL differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.config.dpo import PREFERENCE_LOSSES


@dataclass(frozen=True)
class PreferenceParams:
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    offset_alpha: float = 0.0
    dpop_lambda: float = 50.0
    discopop_tau: float = 0.05
    pref_loss_ratio: float = 1.0
    sft_loss_ratio: float = 0.0


@dataclass(frozen=True)
class Pairs:
    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor
    weight: torch.Tensor
    score_delta: torch.Tensor | None = None
    token_scale: torch.Tensor | None = None
    """The step's pairs over its chosen tokens (all micro-batches, all ranks): with it, the NLL terms are
    one token mean over the whole step; without it (evaluation), over the micro-batch."""

    @property
    def lc(self) -> torch.Tensor:
        return self.policy_chosen - self.ref_chosen

    @property
    def lr(self) -> torch.Tensor:
        return self.policy_rejected - self.ref_rejected

    @property
    def h(self) -> torch.Tensor:
        return self.lc - self.lr

    @property
    def h_per_token(self) -> torch.Tensor:
        """``lc / len_c - lr / len_r``: the margin of per-token log-ratios."""
        return self.lc / self.chosen_len.clamp(min=1) - self.lr / self.rejected_len.clamp(min=1)

    @property
    def mc(self) -> torch.Tensor:
        return self.policy_chosen / self.chosen_len.clamp(min=1)

    @property
    def mr(self) -> torch.Tensor:
        return self.policy_rejected / self.rejected_len.clamp(min=1)

    def batch_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over the micro-batch's pairs (padding pairs excluded)."""
        return (values * self.weight).sum() / self.weight.sum().clamp(min=1)


LossFn = Callable[[PreferenceParams, Pairs], torch.Tensor]


def _smoothed(x: torch.Tensor, e: float) -> torch.Tensor:
    return -(1 - e) * F.logsigmoid(x) - e * F.logsigmoid(-x)


def sigmoid(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """DPO (Rafailov 2023), conservative with label smoothing (Mitchell 2023), ERNIEKit's score offset:
    ``z = h - offset_alpha / b * log(score_delta + 1e-6)`` (when offset_alpha > 0, else ``z = h``);
    ``-(1-e) ls(b z) - e ls(-b z)``. TRL 1.16's sigmoid has no label smoothing and no offset."""
    z = x.h
    if p.offset_alpha > 0:
        assert x.score_delta is not None
        delta = torch.where(x.weight > 0, x.score_delta, 1.0)  # padding pairs carry no scores
        z = z - p.offset_alpha / p.beta * torch.log(delta + 1e-6)
    return _smoothed(p.beta * z, p.label_smoothing)


def hinge(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """SLiC (Zhao 2023): ``relu(1 - b h)`` (ERNIEKit, TRL)."""
    return torch.relu(1 - p.beta * x.h)


def ipo(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """IPO (Azar 2023, eq. 17) on per-token means, as ERNIEKit and TRL compute it:
    ``(lc / len_c - lr / len_r - 1 / (2 b))^2``."""
    return (x.h_per_token - 1 / (2 * p.beta)) ** 2


def simpo(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """SimPO (Meng 2024), reference-free: ``z = mc - mr - gamma / b``; ``-(1-e) ls(b z) - e ls(-b z)``
    (ERNIEKit; TRL's CPO trainer the same)."""
    return _smoothed(p.beta * (x.mc - x.mr) - p.simpo_gamma, p.label_smoothing)


def _odds_ratio(x: Pairs) -> torch.Tensor:
    """``-ls(log_odds)``, ``log_odds = (mc - mr) - (log(1 - exp mc) - log(1 - exp mr))`` (ORPO eqs. 4, 7)."""
    cap = 1 - 1e-6
    log_odds = (x.mc - x.mr) - (
        torch.log1p(-torch.exp(x.mc).clamp(max=cap)) - torch.log1p(-torch.exp(x.mr).clamp(max=cap))
    )
    return -F.logsigmoid(log_odds)


def sft_nll(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """The chosen answers' NLL as one token mean over the batch (TRL's ``sft``, ERNIEKit's ``sft_loss``):
    ``-sum(policy_chosen) / sum(len_c)``, the same value for every pair. With ``token_scale`` the batch is
    the whole step: each pair carries ``-policy_chosen x pairs / tokens`` of the step, which the loop's mean
    over the step's pairs turns into the step's token mean (equal to the sources' when a step is one
    micro-batch on one process, and the same on any process count)."""
    if x.token_scale is not None:
        return -x.policy_chosen * x.token_scale
    total = -(x.policy_chosen * x.weight).sum() / (x.chosen_len * x.weight).sum().clamp(min=1)
    return total.expand_as(x.policy_chosen)


def orpo(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """ORPO (Hong 2024) as the paper and TRL's ORPO trainer: the chosen NLL (one token mean over the batch)
    ``+ b * -ls(log_odds)``. ERNIEKit's ``orpo`` is ``or`` with sft_loss_ratio 1 (``posttrain convert``
    writes it so)."""
    return sft_nll(p, x) + p.beta * _odds_ratio(x)


def odds_ratio(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """ERNIEKit's ``or``: the odds-ratio term alone, ``-ls(log_odds)``, weighted by pref_loss_ratio."""
    return _odds_ratio(x)


def dpop(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """DPO-Positive as ERNIEKit computes it: ``-ls(b h) + dpop_lambda * max(0, ref_chosen - policy_chosen)``.
    The paper (Pal 2024) puts the penalty inside the sigmoid, ``-ls(b (h - lambda max(0, ...)))``."""
    return -F.logsigmoid(p.beta * x.h) + p.dpop_lambda * torch.clamp(x.ref_chosen - x.policy_chosen, min=0)


def kto_pair(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """KTO on pairs (HALOs eq. 7; ERNIEKit): ``KLc = max(0, mean lc)``, ``KLr = max(0, mean lr)`` over the
    batch; the chosen half ``1 - s(b (lc - KLr))`` and the rejected half ``1 - s(b (KLc - lr))``, averaged
    (the sources take the mean over both halves)."""
    kl_chosen = x.batch_mean(x.lc).clamp(min=0)
    kl_rejected = x.batch_mean(x.lr).clamp(min=0)
    chosen = 1 - torch.sigmoid(p.beta * (x.lc - kl_rejected))
    rejected = 1 - torch.sigmoid(p.beta * (kl_chosen - x.lr))
    return (chosen + rejected) / 2


def sppo_hard(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """SPPO with hard probabilities (Wu 2024, eq. 4.7 with P = 1/0): ``(lc - 0.5/b)^2 + (lr + 0.5/b)^2``
    (ERNIEKit, TRL)."""
    return (x.lc - 0.5 / p.beta) ** 2 + (x.lr + 0.5 / p.beta) ** 2


def nca_pair(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """NCA (Chen 2024): ``-ls(b lc) - 0.5 ls(-b lc) - 0.5 ls(-b lr)`` (ERNIEKit, TRL)."""
    c, r = p.beta * x.lc, p.beta * x.lr
    return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)


def robust(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """Robust DPO (Chowdhury 2024), unbiased under label noise e:
    ``(-(1-e) ls(b h) + e ls(-b h)) / (1 - 2e)`` (TRL)."""
    e, z = p.label_smoothing, p.beta * x.h
    return (-(1 - e) * F.logsigmoid(z) + e * F.logsigmoid(-z)) / (1 - 2 * e)


def bco_pair(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """BCO on pairs as TRL 1.16 computes it: ``-ls(b lc) - ls(-b lr)`` (no running reward mean)."""
    return -F.logsigmoid(p.beta * x.lc) - F.logsigmoid(-p.beta * x.lr)


def exo_pair(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """EXO (Ji 2024, eq. 16) with K = 2: ``q = s(b h)``;
    ``q (ls(b h) - log(1-e)) + (1-q) (ls(-b h) - log e)``, e = label_smoothing > 0 (TRL)."""
    e, z = p.label_smoothing, p.beta * x.h
    q = torch.sigmoid(z)
    return q * (F.logsigmoid(z) - math.log1p(-e)) + (1 - q) * (F.logsigmoid(-z) - math.log(e))


def _sorted_real(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``values`` sorted ascending with the padding pairs last (as zeros), so two such sortings pair the
    k-th smallest real values."""
    big = torch.finfo(values.dtype).max
    ordered = torch.sort(torch.where(weight > 0, values, big)).values
    return torch.where(ordered == big, torch.zeros_like(ordered), ordered)


def _aligned(p: PreferenceParams, x: Pairs, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    delta = _sorted_real(a, x.weight) - _sorted_real(b, x.weight)
    # the sorted losses belong to no pair in particular: the k-th loss goes to the k-th real pair
    loss = _smoothed(p.beta * delta, p.label_smoothing)
    ranks = torch.argsort(torch.argsort(-x.weight, stable=True), stable=True)
    return loss[ranks]


def aot(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """AOT (Melnyk 2024), paired: sort ``policy_c - policy_r`` and ``ref_c - ref_r`` over the batch;
    ``d = sorted - sorted_ref``; ``-(1-e) ls(b d) - e ls(-b d)`` (TRL)."""
    return _aligned(p, x, x.policy_chosen - x.policy_rejected, x.ref_chosen - x.ref_rejected)


def aot_pair(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """AOT, unpaired (TRL's ``aot_unpaired``, formerly ``aot_pair``): ``d = sort(lc) - sort(lr)``;
    ``-(1-e) ls(b d) - e ls(-b d)``."""
    return _aligned(p, x, x.lc, x.lr)


def apo_zero(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """APO-zero (D'Oosterlinck 2024, eq. 7), chosen answers better than the model's:
    ``1 - s(b lc) + s(b lr)`` (TRL)."""
    return 1 - torch.sigmoid(p.beta * x.lc) + torch.sigmoid(p.beta * x.lr)


def apo_down(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """APO-down (eq. 8), chosen answers worse than the model's: ``s(b lc) + 1 - s(b h)`` (TRL)."""
    return torch.sigmoid(p.beta * x.lc) + 1 - torch.sigmoid(p.beta * x.h)


def discopop(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """DiscoPOP (Chris Lu 2024, eq. 5): ``z = b h``, ``m = s(z / tau)``; ``-ls(z) (1 - m) + exp(-z) m``
    (TRL)."""
    z = p.beta * x.h
    m = torch.sigmoid(z / p.discopop_tau)
    return -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m


def sigmoid_norm(p: PreferenceParams, x: Pairs) -> torch.Tensor:
    """DPO on per-token means (TRL): ``-ls(b (lc / len_c - lr / len_r))``."""
    return -F.logsigmoid(p.beta * x.h_per_token)


#: each loss_type's function (its name, reference use and options: ``config.dpo.PREFERENCE_LOSSES``)
LOSS_FUNCTIONS: dict[str, LossFn] = {
    "sigmoid": sigmoid,
    "hinge": hinge,
    "ipo": ipo,
    "simpo": simpo,
    "orpo": orpo,
    "or": odds_ratio,
    "dpop": dpop,
    "kto_pair": kto_pair,
    "sppo_hard": sppo_hard,
    "nca_pair": nca_pair,
    "robust": robust,
    "bco_pair": bco_pair,
    "exo_pair": exo_pair,
    "aot": aot,
    "aot_pair": aot_pair,
    "apo_zero": apo_zero,
    "apo_down": apo_down,
    "discopop": discopop,
    "sft": sft_nll,
    "sigmoid_norm": sigmoid_norm,
}
assert LOSS_FUNCTIONS.keys() == PREFERENCE_LOSSES.keys()


def preference_loss(params: PreferenceParams, x: Pairs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pref_loss_ratio * sum_k w_k loss_k + sft_loss_ratio * sft`` per pair, and each pair's implicit
    rewards (``b lc``, ``b lr``; ``b mc``, ``b mr`` when every loss is reference-free and length-normalised).
    """
    total = sum(
        (
            w * LOSS_FUNCTIONS[name](params, x)
            for name, w in zip(params.loss_type, params.loss_weights, strict=True)
        ),
        torch.zeros_like(x.policy_chosen),
    )
    total = params.pref_loss_ratio * total
    if params.sft_loss_ratio:
        total = total + params.sft_loss_ratio * sft_nll(params, x)
    if all(not PREFERENCE_LOSSES[name].reference for name in params.loss_type):
        return total, params.beta * x.mc, params.beta * x.mr
    return total, params.beta * x.lc, params.beta * x.lr
