"""The pure parts of grpo's dynamic sampling: which groups carry signal, which group fills each place of
the batch, and a completion left out of the loss."""

from __future__ import annotations

import math

import torch

from posttrain.generation.types import Completions
from posttrain.methods.grpo.dynamic_sampling import kept_groups, places
from posttrain.rollout.feed import IN_LOSS, training_micro_batches


def test_a_group_is_kept_when_its_rewards_differ_and_its_mean_is_inside_the_range() -> None:
    totals = torch.tensor(
        [1, 1, 1, 1]  # all solved: no spread
        + [0, 1, 0, 0]  # a spread, mean 0.25
        + [0.5, 0.5 + 1e-12, 0.5, 0.5]  # a spread, however small (exact comparison, as NeMo-RL's)
        + [math.nan, 0, math.nan, 0]  # the scored ones all 0: no spread
        + [math.nan] * 4,  # nothing scored
        dtype=torch.float64,
    )
    assert kept_groups(totals, 4, None).tolist() == [False, True, True, False, False]
    # OpenRLHF's dynamic_filtering_range: the mean strictly inside
    assert kept_groups(totals, 4, (0.3, 1.0)).tolist() == [False, False, True, False, False]
    assert kept_groups(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2, (0.0, 1.0)).tolist() == [True, False]


def test_kept_groups_stay_and_refills_take_the_empty_places_in_order() -> None:
    first = torch.tensor([True, False, True, False])
    second = torch.tensor([False, True, True, False])
    assert places([first, second]) == [(0, 0, True), (1, 1, True), (0, 2, True), (1, 2, True)]
    # rounds spent: an empty place keeps its own filtered group, out of the loss
    third = torch.tensor([False, False, False, True])
    assert places([first, third]) == [(0, 0, True), (1, 3, True), (0, 2, True), (0, 3, False)]
    assert places([first]) == [(0, 0, True), (0, 1, False), (0, 2, True), (0, 3, False)]


def test_a_completion_out_of_the_loss_has_no_target_tokens() -> None:
    completions = Completions([[5, 6, 2], [7, 2]], [False, False])
    values = {"advantages": torch.tensor([0.5, -0.5]), IN_LOSS: torch.tensor([1.0, 0.0])}
    (batch,) = training_micro_batches([[1, 3], [1, 4, 3]], completions, values, 2, 0, False)
    assert batch["completion_mask"].sum(dim=1).tolist() == [3.0, 0.0]
    assert IN_LOSS not in batch and batch["advantages"].tolist() == [0.5, -0.5]
