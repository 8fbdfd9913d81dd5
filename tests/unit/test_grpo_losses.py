"""GRPO-family objectives against hand computations on fixed numbers (methods/grpo/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.methods.grpo.losses import (
    STD_EPSILON,
    PolicyLoss,
    advantages,
    k3,
    loss_sum,
    loss_units,
    nanstd,
    token_losses,
)
from posttrain.methods.grpo.method import batch_records

REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # two groups of 4: one split, one with no spread


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))  # unbiased, as TRL


def test_group_advantages_centre_and_scale_per_group() -> None:
    got = advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, "grpo", "group").tolist()
    scale = _std(REWARDS[:4]) + STD_EPSILON
    assert got == pytest.approx([0.5 / scale, -0.5 / scale, -0.5 / scale, 0.5 / scale, 0, 0, 0, 0], abs=1e-15)


def test_batch_and_no_scaling() -> None:
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    centred = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    batch = advantages(rewards, 4, "grpo", "batch").tolist()
    assert batch == pytest.approx([c / (_std(REWARDS) + STD_EPSILON) for c in centred], abs=1e-15)
    assert advantages(rewards, 4, "grpo", "none").tolist() == pytest.approx(centred, abs=1e-15)


def test_rloo_baseline_is_the_mean_of_the_others() -> None:
    got = advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, "rloo", "none").tolist()
    hand = []
    for group in (REWARDS[:4], REWARDS[4:]):
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            hand.append(r - sum(others) / len(others))
    assert got == pytest.approx(hand, abs=1e-15)


# TRL 1.16: a completion every reward function returned None for is NaN, out of its group's baseline and spread
NAN = math.nan
WITH_UNSCORED = [1.0, NAN, 0.0, 3.0, NAN, NAN, 2.0, NAN]  # group 1: three scored; group 2: one scored


def _scored(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def test_unscored_completions_are_left_out_of_the_group_and_get_advantage_zero() -> None:
    rewards = torch.tensor(WITH_UNSCORED, dtype=torch.float64)
    first = _scored(WITH_UNSCORED[:4])  # [1, 0, 3]: mean 4/3, unbiased std
    mean, std = sum(first) / 3, _std(first)
    group = advantages(rewards, 4, "grpo", "group").tolist()
    expected = [
        (1 - mean) / (std + STD_EPSILON),
        0.0,
        (0 - mean) / (std + STD_EPSILON),
        (3 - mean) / (std + STD_EPSILON),
    ]
    assert group[:4] == pytest.approx(expected, abs=1e-15)
    assert group[4:] == [0.0, 0.0, 0.0, 0.0]  # one scored completion: no spread (NaN), advantage 0
    none = advantages(rewards, 4, "grpo", "none").tolist()
    assert none == pytest.approx([1 - mean, 0.0, -mean, 3 - mean, 0.0, 0.0, 0.0, 0.0], abs=1e-15)
    batch = advantages(rewards, 4, "grpo", "batch").tolist()
    everyone = _std(_scored(WITH_UNSCORED))  # TRL's batch std over every scored completion
    assert batch[:4] == pytest.approx(
        [
            (1 - mean) / (everyone + STD_EPSILON),
            0.0,
            -mean / (everyone + STD_EPSILON),
            (3 - mean) / (everyone + STD_EPSILON),
        ],
        abs=1e-15,
    )
    assert batch[4:] == [0.0, 0.0, 0.0, 0.0]  # 2 - its group's mean (itself)
    # rloo: the mean of the other *scored* completions (TRL's RLOOTrainer), 0/0 for a lone scored one
    rloo = advantages(rewards, 4, "rloo", "none").tolist()
    assert rloo == pytest.approx([1 - 1.5, 0.0, 0 - 2.0, 3 - 0.5, 0.0, 0.0, 0.0, 0.0], abs=1e-15)


def test_nanstd_is_trls() -> None:
    values = torch.tensor([[1.0, NAN, 0.0, 3.0], [NAN, NAN, 2.0, NAN]], dtype=torch.float64)
    assert nanstd(values, dim=1)[0].item() == pytest.approx(_std([1.0, 0.0, 3.0]), abs=1e-15)
    assert math.isnan(nanstd(values, dim=1)[1].item())  # one value: no spread
    plain = torch.tensor(REWARDS, dtype=torch.float64)
    assert nanstd(plain).item() == pytest.approx(plain.std().item(), abs=1e-15)
    trl = pytest.importorskip("trl.trainer.utils")  # where TRL is installed: its own function agrees
    assert torch.equal(nanstd(values, dim=1).isnan(), trl.nanstd(values, dim=1).isnan())
    assert nanstd(values, dim=1)[0].item() == trl.nanstd(values, dim=1)[0].item()


def test_rollout_records_are_trls() -> None:
    """``reward``/``reward_std`` over the batch's scored completions (TRL 1.16's ``nanmean``/``nanstd``),
    ``frac_reward_zero_std`` from the spread the advantages use, terminated lengths, each function's mean and
    std over what it scored."""
    per_function = torch.tensor(
        [[1.0, 0.0], [NAN, NAN], [0.0, NAN], [3.0, 1.0], [NAN, NAN], [NAN, NAN], [2.0, 2.0], [NAN, NAN]],
        dtype=torch.float64,
    )
    totals = torch.tensor(WITH_UNSCORED, dtype=torch.float64)  # weights 1 and 0 (the second only logged)
    lengths = torch.tensor([4.0, 8.0, 2.0, 8.0, 5.0, 8.0, 3.0, 1.0], dtype=torch.float64)
    truncated = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    got = batch_records(per_function, totals, lengths, truncated, ["a", "b"], 4, "group")
    scored = _scored(WITH_UNSCORED)
    assert got["reward"] == pytest.approx(sum(scored) / len(scored), abs=1e-15)
    assert got["reward_std"] == pytest.approx(_std(scored), abs=1e-15)
    assert got["reward_std_group"] == pytest.approx(_std([1.0, 0.0, 3.0]), abs=1e-15)  # the lone group is NaN
    assert got["frac_reward_zero_std"] == 0.0  # a NaN spread is not zero (torch.isclose)
    terminated = [4.0, 2.0, 5.0, 3.0, 1.0]
    assert (got["completions/mean_terminated_length"], got["completions/min_terminated_length"]) == (3.0, 1.0)
    assert got["completions/max_terminated_length"] == max(terminated)
    assert got["completions/clipped_ratio"] == 3 / 8
    assert got["rewards/a/mean"] == pytest.approx(1.5) and got["rewards/a/std"] == pytest.approx(
        _std([1.0, 0.0, 3.0, 2.0])
    )
    assert got["rewards/b/mean"] == pytest.approx(1.0) and got["rewards/b/std"] == pytest.approx(1.0)
    flat = batch_records(
        per_function[:, :1].nan_to_num(),
        torch.tensor(REWARDS, dtype=torch.float64),
        lengths,
        torch.ones(8, dtype=torch.float64),
        ["a"],
        4,
        "group",
    )
    assert flat["frac_reward_zero_std"] == 0.5  # the second group has no spread: half the completions
    assert flat["completions/mean_terminated_length"] == 0.0  # none ended: TRL logs 0


LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]], dtype=torch.float64)
OLD = torch.tensor([[-1.1, -1.5, -0.5], [-0.9, -1.2, -3.0]], dtype=torch.float64)
REF = torch.tensor([[-1.3, -2.2, -0.4], [-0.2, -1.0, -3.5]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
ADV = torch.tensor([0.8, -1.5], dtype=torch.float64)


def _hand_token_loss(
    logp: float, old: float, a: float, low: float, high: float, ratio: float | None = None
) -> float:
    r = math.exp(logp - old) if ratio is None else ratio
    return -min(r * a, min(max(r, 1 - low), 1 + high) * a)


def test_clipped_token_losses_with_clip_higher() -> None:
    params = PolicyLoss("dapo", epsilon=0.2, epsilon_high=0.28)
    losses, stats = token_losses(params, LOGPS, OLD, None, ADV, MASK)
    for i in range(2):
        for t in range(3):
            hand = _hand_token_loss(LOGPS[i, t].item(), OLD[i, t].item(), ADV[i].item(), 0.2, 0.28)
            assert losses[i, t].item() == pytest.approx(hand, abs=1e-15), (i, t)
    # token (0,1): ratio e^-0.5 = 0.61 < 0.8 with a positive advantage: not clipped (min keeps the ratio);
    # token (1,0): ratio e^0.6 = 1.82 > 1.28 with a negative advantage: not clipped either
    ratio = torch.exp(LOGPS - OLD)
    low = (ratio < 0.8) & (ADV[:, None] < 0)
    high = (ratio > 1.28) & (ADV[:, None] > 0)
    assert torch.equal(stats["clip_ratio/low_mean"], low.double())
    assert torch.equal(stats["clip_ratio/high_mean"], high.double())
    assert "kl" not in stats


def test_sequence_level_ratio_is_the_mean_log_ratio_of_the_completion() -> None:
    params = PolicyLoss("grpo", epsilon=0.2, epsilon_high=0.2, sequence_ratio=True)
    losses, _ = token_losses(params, LOGPS, OLD, None, ADV, MASK)
    for i in range(2):
        kept = [t for t in range(3) if MASK[i, t] > 0]
        mean = sum(LOGPS[i, t].item() - OLD[i, t].item() for t in kept) / len(kept)
        for t in range(3):
            hand = _hand_token_loss(0, 0, ADV[i].item(), 0.2, 0.2, ratio=math.exp(mean))
            assert losses[i, t].item() == pytest.approx(hand, abs=1e-15)


def test_k3_kl_against_the_reference() -> None:
    kl = k3(LOGPS, REF)
    for i in range(2):
        for t in range(3):
            d = REF[i, t].item() - LOGPS[i, t].item()
            assert kl[i, t].item() == pytest.approx(math.exp(d) - d - 1, abs=1e-15)
    plain = PolicyLoss("dapo", beta=0.04, epsilon=0.2, epsilon_high=0.2, bias_correction_kl=False)
    with_kl, stats = token_losses(plain, LOGPS, OLD, REF, ADV, MASK)
    without, _ = token_losses(PolicyLoss("dapo", epsilon=0.2, epsilon_high=0.2), LOGPS, OLD, None, ADV, MASK)
    assert torch.allclose(with_kl, without + 0.04 * kl, atol=1e-15) and torch.equal(stats["kl"], kl)
    # TRL's use_bias_correction_kl (its default): the KL term times the unclipped ratio, per token...
    ratio = torch.exp(LOGPS - OLD)
    corrected, stats = token_losses(PolicyLoss("dapo", beta=0.04), LOGPS, OLD, REF, ADV, MASK)
    assert torch.allclose(corrected, without + 0.04 * kl * ratio, atol=1e-15)
    assert torch.allclose(stats["kl"], kl * ratio, atol=1e-15)
    # ... or per completion under GSPO: exp(the completion's mean log-ratio) broadcast onto its tokens
    gspo = PolicyLoss("dapo", beta=0.04, sequence_ratio=True)
    _, stats = token_losses(gspo, LOGPS, OLD, REF, ADV, MASK)
    for i in range(2):
        kept = [t for t in range(3) if MASK[i, t] > 0]
        mean = sum(LOGPS[i, t].item() - OLD[i, t].item() for t in kept) / len(kept)
        assert stats["kl"][i].tolist() == pytest.approx((kl[i] * math.exp(mean)).tolist(), abs=1e-15)
    # on-policy the ratio is 1, yet its gradient reaches the KL term: d/dl [k3 * exp(l - l_old)] = k3 + dk3/dl
    logps = LOGPS.clone().requires_grad_(True)
    loss, _ = token_losses(
        PolicyLoss("dapo", beta=1.0), logps, LOGPS, REF, torch.zeros(2, dtype=torch.float64), MASK
    )
    (loss * MASK).sum().backward()
    d = REF - LOGPS
    assert torch.allclose(logps.grad, (torch.exp(d) - d - 1 + (1 - torch.exp(d))) * MASK, atol=1e-12)


def test_gspo_clip_statistics_count_completions() -> None:
    """With one ratio per completion (GSPO), the clip shares are per completion, as TRL logs them."""
    params = PolicyLoss("grpo", epsilon=0.01, epsilon_high=0.01, sequence_ratio=True)
    _, stats = token_losses(params, LOGPS, OLD, None, ADV, MASK)
    assert all(stats[k].shape == (2, 1) for k in ("clip_ratio/low_mean", "clip_ratio/high_mean"))
    _, per_token = token_losses(
        PolicyLoss("grpo", epsilon=0.01, epsilon_high=0.01), LOGPS, OLD, None, ADV, MASK
    )
    assert per_token["clip_ratio/region_mean"].shape == LOGPS.shape


def test_each_loss_type_aggregates_as_its_paper_does() -> None:
    losses = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]], dtype=torch.float64)  # (0,2) is masked out
    grpo = loss_sum(PolicyLoss("grpo"), losses, MASK).item()
    assert grpo == pytest.approx((1 + 2) / 2 + (3 + 4 + 5) / 3, abs=1e-15)
    assert loss_units(PolicyLoss("grpo"), MASK) == 2
    assert loss_sum(PolicyLoss("dapo"), losses, MASK).item() == pytest.approx(1 + 2 + 3 + 4 + 5, abs=1e-15)
    assert loss_units(PolicyLoss("dapo"), MASK) == 5
    dr = PolicyLoss("dr_grpo", max_completion_length=8)
    assert loss_sum(dr, losses, MASK).item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 8, abs=1e-15)
    assert loss_units(dr, MASK) == 2


def test_split_over_micro_batches_and_ranks_gives_the_whole_batch_loss() -> None:
    """What the loop does with the sums: the step's loss is sum over parts / units over parts, the same as
    the whole batch's (dapo per token across micro-batches, grpo per completion)."""
    losses = torch.rand(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    mask[:, 0] = 1
    for kind in ("grpo", "dapo", "dr_grpo"):
        params = PolicyLoss(kind, max_completion_length=5)
        whole = loss_sum(params, losses, mask) / loss_units(params, mask)
        parts = [(losses[a:b], mask[a:b]) for a, b in ((0, 2), (2, 3), (3, 6))]
        split = sum(loss_sum(params, x, m) for x, m in parts) / sum(loss_units(params, m) for _, m in parts)
        assert split.item() == pytest.approx(whole.item(), abs=1e-15), kind


@pytest.mark.parametrize("kind", ["grpo", "dapo", "dr_grpo"])
def test_on_policy_the_ratio_is_one_and_the_gradient_is_reinforce_with_the_group_baseline(kind: str) -> None:
    logps = LOGPS.clone().requires_grad_(True)
    params = PolicyLoss(kind, epsilon=0.2, epsilon_high=0.28, max_completion_length=3)
    losses, stats = token_losses(params, logps, logps.detach(), None, ADV, MASK)
    loss_sum(params, losses, MASK).backward()
    assert not stats["clip_ratio/region_mean"].any()  # ratio 1: nothing clipped
    reference = logps.detach().clone().requires_grad_(True)
    reinforce = -ADV[:, None] * reference  # REINFORCE: -A log pi, the same normalisation
    loss_sum(
        PolicyLoss("grpo" if kind == "grpo" else kind, max_completion_length=3), reinforce, MASK
    ).backward()
    assert torch.allclose(logps.grad, reference.grad, atol=1e-15)


def test_reinforce_has_no_ratio() -> None:
    losses, stats = token_losses(PolicyLoss("reinforce"), LOGPS, OLD, None, ADV, MASK)
    assert torch.equal(losses, -ADV[:, None] * LOGPS) and not stats


def test_token_logps_and_entropy_agree_on_the_tiled_path() -> None:
    """grpo's log-probabilities and entropy from whole logits and from the tiled head (chunks of rows, no
    whole logits held): equal at every labelled position, at the sampling temperature."""
    from posttrain.data.samples import IGNORE_INDEX
    from posttrain.models.token_logps import token_logps
    from posttrain.tiny_model import build_model

    model = build_model(512, hidden_size=32, heads=2, seed=1).double()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (3, 20), generator=generator)
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX  # the prompt
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    plain, plain_entropy = token_logps(model, batch, False, temperature=0.7, entropy=True)
    tiled, tiled_entropy = token_logps(model, batch, True, temperature=0.7, entropy=True)
    labelled = torch.zeros_like(labels, dtype=torch.bool)
    labelled[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    assert torch.allclose(plain[labelled], tiled[labelled].to(plain.dtype), atol=1e-5)
    assert torch.allclose(plain_entropy[labelled], tiled_entropy[labelled].to(plain_entropy.dtype), atol=1e-5)
    assert tiled_entropy[labelled].min() > 0 and (tiled_entropy[~labelled] == 0).all()


def test_extreme_clip_shares_are_trls_per_micro_batch() -> None:
    """``clip_ratio/low_min``: the smallest per-completion share of low-clipped tokens; ``high_max``: the
    largest of high-clipped ones (TRL's masked_seq_mean, then nanmin/nanmax over the gathered completions)."""
    from posttrain.methods.grpo import extreme_clip_shares
    from posttrain.methods.grpo.losses import sequence_shares

    mask = torch.tensor(
        [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    low = torch.tensor(
        [[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64
    )
    high = torch.tensor(
        [[0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64
    )
    shares = sequence_shares(low, mask)
    assert shares[:2].tolist() == pytest.approx([2 / 3, 1.0]) and math.isnan(shares[2])  # no token: NaN
    got = extreme_clip_shares({"clip_ratio/low_mean": low, "clip_ratio/high_mean": high}, mask)
    assert got["clip_ratio/low_min"].item() == pytest.approx(2 / 3)  # the empty completion is left out
    assert got["clip_ratio/high_max"].item() == pytest.approx(1 / 2)
    assert got["clip_ratio/low_min:count"].item() == 1.0  # each micro-batch counts once
