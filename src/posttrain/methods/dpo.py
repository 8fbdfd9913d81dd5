"""DPO-family preference tuning (``type: dpo``).

The reference model's log-probabilities are computed once, before the first step (``prepare``), with the
policy's initial weights or the configured ``ref_model``, and stored with each pair. The reference is
therefore frozen by construction, takes no memory or time during training, never gets an optimizer, and
works the same under every ZeRO stage and process count (the pass runs through the DeepSpeed engine).
The loss is a mean over pairs: the loop divides the summed loss by the number of pairs in the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from posttrain.config.dpo import DPOTrainerConfig
from posttrain.context import RunContext
from posttrain.data.build import DataFactory, Datasets
from posttrain.data.dpo import PAIR_COLUMNS, SCORES, PairCollator, fit_pair, format_dpo_row
from posttrain.data.samples import IGNORE_INDEX, target_labels
from posttrain.data.store import loop_format
from posttrain.dist import all_reduce_sum
from posttrain.methods.preference_losses import Pairs, PreferenceParams, preference_loss
from posttrain.methods.reference_pass import reference_pass
from posttrain.models.token_logps import row_nll
from posttrain.training.steps import LoaderSteps, loader_steps

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.plan import Batches
    from posttrain.registry import LossFunction
    from posttrain.training.engine import Engine

# ------------------------------------------------------------------------------------------------- loss


def pair_logps(model: Any, batch: dict[str, Any], tiled: bool | str = False) -> tuple[torch.Tensor, ...]:
    """Chosen and rejected summed log-probabilities of the labelled tokens, and how many there are (the
    collator stacks the chosen rows on top of the rejected ones)."""
    logps = -row_nll(model, batch, tiled).double()
    counts = (target_labels(batch) != IGNORE_INDEX).sum(-1).double()
    half = logps.shape[0] // 2
    return logps[:half], logps[half:], counts[:half], counts[half:]


def preference_params(config: DPOTrainerConfig) -> PreferenceParams:
    return PreferenceParams(
        loss_type=config.loss_types,
        loss_weights=config.weights,
        beta=config.beta,
        label_smoothing=config.label_smoothing,
        simpo_gamma=config.simpo_gamma,
        offset_alpha=config.offset_alpha,
        dpop_lambda=config.dpop_lambda,
        discopop_tau=config.discopop_tau,
        pref_loss_ratio=config.pref_loss_ratio,
        sft_loss_ratio=config.sft_loss_ratio,
    )


def make_dpo_loss(
    config: DPOTrainerConfig, tokenizer: PreTrainedTokenizerBase | None = None, steps: object = None
) -> LossFunction:
    """dpo's ``loss`` hook (``registry.LossBuilder``): the configured preference loss (or weighted list) of
    each pair, summed; the loop divides by the step's pairs."""
    params = preference_params(config)

    def dpo_loss(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chosen, rejected, chosen_len, rejected_len = pair_logps(model, batch, config.tiled_loss_compute)
        weight = batch["pair_weight"]
        pairs = Pairs(
            chosen,
            rejected,
            batch["ref_chosen"],
            batch["ref_rejected"],
            chosen_len,
            rejected_len,
            weight,
            batch.get("score_delta"),
            batch.get("token_scale"),
        )
        losses, chosen_reward, rejected_reward = preference_loss(params, pairs)
        metrics = {
            "rewards/chosen": (chosen_reward * weight).sum(),
            "rewards/rejected": (rejected_reward * weight).sum(),
            "rewards/margins": ((chosen_reward - rejected_reward) * weight).sum(),
            # a tie (as before the first update, when the policy is the reference) counts one half
            "rewards/accuracy": ((torch.sign(chosen_reward - rejected_reward) + 1) / 2 * weight).sum(),
            "logps/chosen": (chosen * weight).sum(),
            "logps/rejected": (rejected * weight).sum(),
        }
        return (losses * weight).sum(), metrics

    return dpo_loss


# ------------------------------------------------------------------------------------------- step feed


class PairSteps:
    """The loader's steps, each micro-batch told the step's pairs per chosen token (over all micro-batches
    and ranks, one small all-reduce), so the NLL terms are one token mean over the step."""

    def __init__(self, inner: LoaderSteps, ctx: RunContext) -> None:
        self.inner, self.ctx = inner, ctx
        self.extras, self.generation = inner.extras, inner.generation

    def steps(self, state: Any) -> Iterator[list[dict[str, Any]]]:
        for micro_batches in self.inner.steps(state):
            local = [sum(m[k] for m in micro_batches) for k in ("num_loss_units", "num_chosen_tokens")]
            pairs, tokens = all_reduce_sum([float(x) for x in local], self.ctx.dist)
            scale = torch.tensor(pairs / max(tokens, 1.0), dtype=torch.float64)
            yield [{**micro, "token_scale": scale} for micro in micro_batches]


def pair_steps(
    ctx: RunContext, engine: Engine, batches: Batches, tokenizer: PreTrainedTokenizerBase
) -> LoaderSteps | PairSteps:
    """dpo's ``steps`` hook (``registry.StepsBuilder``): the loader's steps, with the step's token scale when
    a loss takes a token mean."""
    inner = loader_steps(ctx, engine, batches, tokenizer)
    config = ctx.config
    assert isinstance(config, DPOTrainerConfig)
    nll = config.sft_loss_ratio > 0 or any(n in ("sft", "orpo") for n in config.loss_types)
    return PairSteps(inner, ctx) if nll else inner


# ------------------------------------------------------------------------------------- reference log-probs


def prepare_reference(ctx: RunContext, engine: Engine, data: Datasets, collator: PairCollator) -> None:
    """dpo's ``prepare`` hook (``registry.Prepare``): the reference's log-probabilities of every pair, once,
    before resuming (the initial weights, or ``ref_model``)."""
    config = ctx.config
    assert isinstance(config, DPOTrainerConfig)
    if not config.needs_reference:
        return
    tiled = config.tiled_loss_compute

    def score(model: Any, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        chosen, rejected, _, _ = pair_logps(model, batch, tiled)
        return {"ref_chosen": chosen, "ref_rejected": rejected}

    reference_pass(ctx, engine, data, collator, score, "pairs")


#: the ``dpo`` data factory (registered in ``posttrain.builtins``)
DATA = DataFactory(
    format_batch=loop_format(format_dpo_row),
    columns=(*PAIR_COLUMNS, SCORES),
    fit=fit_pair,
    parts={
        "": "the answers' tokens the loss reads",
        "chosen_": "chosen (preferred)",
        "rejected_": "rejected",
    },
)
