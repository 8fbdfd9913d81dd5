"""DAPO's dynamic sampling for grpo (``dynamic_sampling``, ``dynamic_filtering_range``,
``max_num_gen_batches``), exact: the batch a step trains is a function of the config.

A group whose completions all have the same total reward gives GRPO no signal (every advantage is 0), and with
``dynamic_filtering_range`` a group whose mean reward is outside the range is dropped too (``kept_groups``).
Its place in the batch is filled by a group of a refill round: round r (1, 2, ...) is P more prompts from the
batch's refill order (``PromptSlots.refill_positions``: a permutation of the epoch's other prompts keyed by
``data.seed``, the epoch and the batch), G completions each, every completion drawn from its own key, from
the weights of the moment (the batches generated ahead waited for first). Rounds go on until every place holds
a kept group or ``max_num_gen_batches`` rounds (the first included) are spent (``places``); a place still
empty then keeps its filtered group, out of the loss. Kept groups of the first round stay where they are;
refilled ones take the empty places in (round, group) order. Nothing here depends on timing or on the number
of processes: rewards are gathered from every rank before any choice, and the chosen completions move to the
rank whose slots they fill."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.dist import all_gather_objects
from posttrain.generation.types import Completions
from posttrain.logs import say
from posttrain.rewards.scorer import Scores
from posttrain.rollout.feed import GeneratedBatch, OnlineSteps


def kept_groups(totals: torch.Tensor, group: int, between: tuple[float, float] | None) -> torch.Tensor:
    """Which groups of a round carry signal (``[groups]`` bool): the scored completions' total rewards are
    not all equal (exactly: no tolerance, as NeMo-RL compares), and with ``between`` their mean is strictly
    inside it. A group no reward scored is dropped."""
    groups = totals.view(-1, group)
    scored = ~torch.isnan(groups)
    highest = torch.where(scored, groups, -torch.inf).amax(dim=1)
    lowest = torch.where(scored, groups, torch.inf).amin(dim=1)
    keep = scored.any(dim=1) & (highest > lowest)
    if between is not None:
        mean = torch.nanmean(groups, dim=1)
        keep &= (mean > between[0]) & (mean < between[1])
    return keep


def places(kept: list[torch.Tensor]) -> list[tuple[int, int, bool]]:
    """Each place of the batch: (round, group, in the loss). A kept group of round 0 stays; an empty place
    takes the next kept group of rounds 1, 2, ... in (round, group) order, or keeps its own filtered group
    out of the loss when none is left."""
    spare = [(r, int(g)) for r in range(1, len(kept)) for g in torch.nonzero(kept[r]).flatten()]
    out = []
    for place, keep in enumerate(kept[0].tolist()):
        if keep:
            out.append((0, place, True))
        elif spare:
            out.append((*spare.pop(0), True))
        else:
            out.append((0, place, False))
    return out


@dataclass
class Round:
    """One round of a batch's generation on this rank, and what every rank scored in it."""

    generated: GeneratedBatch
    scores: Scores  # this rank's completions'
    everyone: torch.Tensor  # [batch completions, rewards + 3] of every rank (grpo's gathered values)
    kept: torch.Tensor  # [groups]


@dataclass
class Filled:
    """The batch a step trains after dynamic sampling: this rank's scores of its slots, every rank's gathered
    values, each completion's place in the loss (``[batch completions]``, 1 or 0) and the step's records."""

    scores: Scores
    everyone: torch.Tensor
    in_loss: torch.Tensor
    records: dict[str, float] = field(default_factory=dict)
    generated_tokens: float = 0.0


class DynamicSampling:
    """The filter and the refill rounds of grpo's batches (see the module docstring)."""

    def __init__(self, config: Any, rewards: int) -> None:
        self.between = config.dynamic_filtering_range
        self.rounds = config.max_num_gen_batches
        self.rewards = rewards  # reward functions: the first columns of the gathered values
        self.short_said = False

    def fill(
        self,
        feed: OnlineSteps,
        generated: GeneratedBatch,
        score: Callable[[GeneratedBatch], tuple[Scores, torch.Tensor]],
        total: Callable[[torch.Tensor], torch.Tensor],
    ) -> Filled:
        """Score the batch, refill it until every place holds a kept group (or the rounds are spent) and put
        the chosen completions in ``generated`` (this rank's slots). ``score``: a round's scores on this rank
        and every rank's gathered values; ``total``: the total rewards of gathered values. Every rank calls
        it at once."""
        group = feed.group
        rounds: list[Round] = []
        source = generated
        while True:
            scores, everyone = score(source)
            kept = kept_groups(total(everyone[:, : self.rewards]), group, self.between)
            rounds.append(Round(source, scores, everyone, kept))
            filled = sum(int(r.kept.sum()) for r in rounds)
            if filled >= len(kept) or len(rounds) >= self.rounds:
                break
            source = feed.refill(generated.epoch, generated.batch, len(rounds))
        chosen = places([r.kept for r in rounds])
        masked = sum(not in_loss for _, _, in_loss in chosen)
        if masked and not self.short_said:
            say(
                f"dynamic_sampling: generated batch {feed.slots.global_batch(generated.epoch, generated.batch)} still "
                f"had {masked} of its {len(chosen)} groups without signal after max_num_gen_batches="
                f"{self.rounds} rounds; they stay in the batch out of the loss (counted each step in "
                "dynamic_sampling/masked_groups; said once). Raise max_num_gen_batches, or widen "
                "dynamic_filtering_range"
            )
            self.short_said = True
        filled_batch = self._move(feed, generated, rounds, chosen)
        groups = len(chosen)
        filtered = sum(int((~r.kept).sum()) for r in rounds)
        filled_batch.records = {
            "dynamic_sampling/kept_share": float(rounds[0].kept.double().mean()),
            "dynamic_sampling/generation_rounds": float(len(rounds)),
            "dynamic_sampling/filtered_groups": float(filtered),
            "dynamic_sampling/extra_completions": float((len(rounds) - 1) * groups * group),
            "dynamic_sampling/masked_groups": float(masked),
            "dynamic_sampling/reward_first_round": float(
                torch.nanmean(total(rounds[0].everyone[:, : self.rewards]))
            ),
        }
        filled_batch.generated_tokens = float(
            sum(r.everyone[:, -3].sum() + r.everyone[:, -2].sum() for r in rounds)
        )
        return filled_batch

    def _move(
        self,
        feed: OnlineSteps,
        generated: GeneratedBatch,
        rounds: list[Round],
        chosen: list[tuple[int, int, bool]],
    ) -> Filled:
        """The chosen completions into this rank's slots of ``generated`` (gathered from every rank when a
        refill was taken), with their scores and gathered values."""
        group = feed.group
        sources = [(r, g * group + c) for r, g, _ in chosen for c in range(group)]  # per slot of the batch
        in_loss = torch.tensor([float(k) for _, _, k in chosen for _ in range(group)], dtype=torch.float64)
        everyone = torch.stack([rounds[r].everyone[s] for r, s in sources])
        if all(r == 0 for r, _ in sources):  # nothing refilled: the batch as generated
            return Filled(rounds[0].scores, everyone, in_loss)
        shares = [self._share(r) for r in rounds]
        every = [all_gather_objects(share, feed.ctx.dist) for share in shares]  # [round][rank]
        mine = feed.mine
        picked = [
            every[r][s // mine]["items"][s % mine]
            for r, s in sources[generated.first : generated.first + mine]
        ]
        generated.rows = [p["row"] for p in picked]
        generated.prompt_ids = [p["prompt_ids"] for p in picked]
        generated.completions = Completions(
            ids=[p["ids"] for p in picked],
            truncated=[p["truncated"] for p in picked],
            logps=None if any(p["logps"] is None for p in picked) else [p["logps"] for p in picked],
        )
        logged: dict[str, list[float]] = {}
        for r in rounds:
            for name, values in r.scores.logged.items():
                logged.setdefault(name, []).extend(values)
        columns = sorted({name for p in picked for name in p["extra"]})
        scores = Scores(
            values=torch.stack([p["values"] for p in picked]),
            extra={name: [p["extra"].get(name) for p in picked] for name in columns},
            logged=logged,
            unscored=[u for r in rounds for u in r.scores.unscored],
        )
        return Filled(scores, everyone, in_loss)

    @staticmethod
    def _share(found: Round) -> dict[str, Any]:
        """What this rank holds of a round, per slot, to send to the rank whose slot it fills."""
        generated, scores, completions = found.generated, found.scores, found.generated.completions
        items = [
            {
                "row": generated.rows[i],
                "prompt_ids": generated.prompt_ids[i],
                "ids": completions.ids[i],
                "truncated": completions.truncated[i],
                "logps": completions.logps[i] if completions.logps is not None else None,
                "values": scores.values[i],
                "extra": {name: logged[i] for name, logged in scores.extra.items() if i < len(logged)},
            }
            for i in range(len(generated.rows))
        ]
        return {"items": items}
