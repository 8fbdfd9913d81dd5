"""KTO (``type: kto``): Kahneman-Tversky optimisation from completions labelled desirable or undesirable.

Each completion's loss compares its log-ratio to the reference, ``r = log pi(y|x) - log ref(y|x)``, with a KL
baseline ``z`` (Ethayarajh et al. 2024, eq. 7): desirable ``w_D (1 - s(b (r - z)))``, undesirable
``w_U (1 - s(b (z - r)))``. ``z`` is the mean log-ratio of the step's mismatched sequences (each sample's
prompt with another row's completion), over every micro-batch and every rank, clipped at 0 and not
differentiated; TRL's KTOTrainer computes it the same way per micro-batch. The reference's log-probs of
every completion and KL sequence are computed once, before training. The loss is a mean over completions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from posttrain.config.kto import KTOTrainerConfig
from posttrain.context import RunContext
from posttrain.data.build import DataFactory, Datasets
from posttrain.data.collate import to_device
from posttrain.data.kto import COLUMNS, KINDS, KTOCollator, fit_kto, format_kto_batch, kl_batch
from posttrain.logs import get_logger
from posttrain.methods.reference_pass import reference_pass
from posttrain.models.token_logps import row_nll
from posttrain.training.extras import COUNT
from posttrain.training.steps import LoaderSteps, loader_steps

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.plan import Batches
    from posttrain.registry import LossFunction
    from posttrain.training.engine import Engine

# ------------------------------------------------------------------------------------------------- loss


def kto_losses(
    config: KTOTrainerConfig,
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
) -> torch.Tensor:
    """Each completion's loss (see the module docstring; ``apo_zero_unpaired``: desirable ``w_D (1 - s(b r))``,
    undesirable ``w_U s(b r)``, no baseline)."""
    ratio, beta = logps - ref_logps, config.beta
    if config.loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    else:
        good, bad = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    return torch.where(desirable, config.desirable_weight * good, config.undesirable_weight * bad)


@torch.no_grad()
def kl_sums(model: Any, batch: dict[str, Any], tiled: bool | str = False) -> torch.Tensor:
    """``[sum of the KL sequences' log-ratios, their count]`` of one micro-batch (on its device)."""
    logps = -row_nll(model, kl_batch(batch), tiled).double()
    weight = batch["kl_weight"]
    return torch.stack([((logps - batch["ref_kl"]) * weight).sum(), weight.sum()])


def kl_baseline(sums: torch.Tensor) -> torch.Tensor:
    """The KL estimate from ``kl_sums`` added over micro-batches: summed over ranks, averaged, clipped at 0."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        sums = sums.clone()
        dist.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0)


def make_kto_loss(
    config: KTOTrainerConfig, tokenizer: PreTrainedTokenizerBase | None = None, steps: object = None
) -> LossFunction:
    """kto's ``loss`` hook (``registry.LossBuilder``): each completion's KTO loss against the step's KL
    baseline, weighted, summed."""
    tiled = config.tiled_loss_compute

    def kto_loss(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if config.loss_type == "kto":
            # training steps bring the step's baseline (KLSteps); an evaluation batch estimates its own
            kl = batch["kl"] if "kl" in batch else kl_baseline(kl_sums(model, batch, tiled))
        else:
            kl = torch.zeros((), dtype=torch.float64, device=batch["ref_logps"].device)
        logps = -row_nll(model, batch, tiled).double()
        desirable, weight = batch["desirable"], batch["row_weight"]
        losses = kto_losses(config, logps, batch["ref_logps"], desirable, kl)
        rewards = config.beta * (logps - batch["ref_logps"]).detach()
        good, bad = weight * desirable, weight * ~desirable
        metrics = {
            "rewards/chosen": (rewards * good).sum(),
            "rewards/chosen" + COUNT: good.sum(),
            "rewards/rejected": (rewards * bad).sum(),
            "rewards/rejected" + COUNT: bad.sum(),
            "logps/chosen": (logps.detach() * good).sum(),
            "logps/chosen" + COUNT: good.sum(),
            "logps/rejected": (logps.detach() * bad).sum(),
            "logps/rejected" + COUNT: bad.sum(),
            "kl": kl.detach() * weight.sum(),
        }
        return (losses * weight).sum(), metrics

    return kto_loss


# ------------------------------------------------------------------------------------------- step feed


class KLSteps:
    """The loader's steps, each given its KL baseline first: every micro-batch's mismatched sequences go
    through the current weights without gradients, and one all-reduce makes the step's estimate."""

    def __init__(self, inner: LoaderSteps, engine: Engine, tiled: bool | str) -> None:
        self.inner, self.engine, self.tiled = inner, engine, tiled
        self.extras, self.generation = inner.extras, inner.generation

    def steps(self, state: Any) -> Iterator[list[dict[str, Any]]]:
        for micro_batches in self.inner.steps(state):
            sums = sum(
                (
                    kl_sums(self.engine, to_device(micro, self.engine.device), self.tiled)
                    for micro in micro_batches
                ),
                torch.zeros(2, dtype=torch.float64, device=self.engine.device),
            )
            kl = kl_baseline(sums)
            yield [{**micro, "kl": kl} for micro in micro_batches]


def kl_steps(
    ctx: RunContext, engine: Engine, batches: Batches, tokenizer: PreTrainedTokenizerBase
) -> LoaderSteps | KLSteps:
    """kto's ``steps`` hook (``registry.StepsBuilder``): the loader's steps, each given its KL baseline
    (``loss_type: kto``)."""
    inner = loader_steps(ctx, engine, batches, tokenizer)
    config = ctx.config
    assert isinstance(config, KTOTrainerConfig)
    return KLSteps(inner, engine, config.tiled_loss_compute) if config.loss_type == "kto" else inner


# ------------------------------------------------------------------------------------- reference log-probs


def _class_balance(config: KTOTrainerConfig, data: Datasets) -> None:
    """Warn when ``w_D n_D / (w_U n_U)`` is outside [1, 4/3] (KTO paper, eq. 8), as TRL does."""
    store = data.train.store
    counts = [int((store.lengths(f"{kind}_input_ids")[data.train.samples] > 0).sum()) for kind in KINDS]
    desirable, undesirable = max(counts[0], 1), max(counts[1], 1)
    ratio = config.desirable_weight * desirable / max(config.undesirable_weight * undesirable, 1e-12)
    if not 1.0 <= ratio <= 4 / 3:
        low = undesirable * config.undesirable_weight / desirable  # the weight that gives a ratio of 1
        high = low * 4 / 3
        get_logger().warning(
            f"KTO class balance: {counts[0]} desirable and {counts[1]} undesirable completions give "
            f"desirable_weight x desirables / (undesirable_weight x undesirables) = {ratio:.2f}, outside the "
            f"[1, 1.33] the KTO paper recommends; set desirable_weight in [{low:.2f}, {high:.2f}] (or "
            "undesirable_weight to match)"
        )


def prepare_reference(ctx: RunContext, engine: Engine, data: Datasets, collator: KTOCollator) -> None:
    """kto's ``prepare`` hook (``registry.Prepare``): the class-balance check and the reference's
    log-probabilities of every completion and KL sequence, once, before resuming."""
    config = ctx.config
    assert isinstance(config, KTOTrainerConfig)
    _class_balance(config, data)
    tiled = config.tiled_loss_compute

    def score(model: Any, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logps = -row_nll(model, batch, tiled).double()
        samples = batch["kl_input_ids"].shape[0]
        out = {}
        for kind, wanted in zip(KINDS, (True, False), strict=True):
            rows = batch["desirable"] == wanted
            values = torch.zeros(samples, dtype=torch.float64, device=logps.device)
            out[f"ref_{kind}"] = values.index_put((batch["row_sample"][rows],), logps[rows])
        out["ref_kl"] = -row_nll(model, kl_batch(batch), tiled).double()
        return out

    reference_pass(ctx, engine, data, collator, score)


#: the ``kto`` data factory (registered in ``posttrain.builtins``)
DATA = DataFactory(
    format_batch=format_kto_batch,
    columns=COLUMNS,
    fit=fit_kto,
    parts={
        "": "the completions' tokens the loss reads",
        "desirable_": "desirable completion (label true)",
        "undesirable_": "undesirable completion (label false)",
        "kl_": "KL baseline: this prompt with the next row's completion (scored, not trained)",
    },
)
