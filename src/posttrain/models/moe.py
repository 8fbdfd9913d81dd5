"""Mixture-of-experts routing: what a model's MoE layers look like, the router's load-balancing loss and the
per-layer expert load, recorded from the routers while the training forward runs.

Hugging Face MoE models add their load-balancing loss only when asked to and only together with their own
LM loss, so posttrain records every router's logits itself (a forward hook on the router class the model
declares for ``router_logits``) and computes the loss here: the Switch-Transformer form the models use,
``num_experts * sum_e f_e * P_e`` over all MoE layers' tokens, ``f_e`` the share of top-k assignments and
``P_e`` the mean router probability of expert ``e``, padding excluded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.config.trainer import TrainerConfig
from posttrain.models.dimensions import Dimensions, read_dimensions


@dataclass(frozen=True)
class MoEFacts:
    """A mixture-of-experts model's routing: experts per layer, experts per token, the load-balancing
    coefficient its config names (``router_aux_loss_coef``)."""

    num_experts: int
    top_k: int
    aux_loss_coef: float


def moe_facts_from_dimensions(dims: Dimensions) -> MoEFacts | None:
    """The routing of a model, or None for a dense model."""
    if not dims.num_experts:
        return None
    return MoEFacts(dims.num_experts, dims.top_k, dims.router_aux_loss_coef)


def moe_facts_from_hf_config(config: Any) -> MoEFacts | None:
    """The routing of a transformers config, or None for a dense model."""
    return moe_facts_from_dimensions(read_dimensions(config))


def router_class(model: torch.nn.Module) -> tuple[type, int] | None:
    """The router module class a transformers model records ``router_logits`` from, and the index of the
    logits in its output."""
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = recorders.get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder.target_class, int(getattr(recorder, "index", 0) or 0)
    return None


def routing_statistics(
    logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """From all layers' router logits (each ``[tokens, experts]``), counting only the tokens where ``mask``
    (``[tokens]``, bool) is true: the Switch-Transformer load-balancing loss, and the top-k assignments per
    layer and expert (``[layers, experts]``, float64), both from one top-k."""
    layers, num_experts = len(logits), logits[0].shape[-1]
    stacked = torch.cat([layer.float() for layer in logits])  # [layers x tokens, experts]
    probs = torch.softmax(stacked, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    assigned = torch.nn.functional.one_hot(chosen, num_experts).to(probs.dtype)  # [rows, k, experts]
    if mask is None:
        weights = torch.ones(stacked.shape[0], dtype=probs.dtype, device=probs.device)
    else:
        weights = mask.to(probs.dtype).repeat(layers)  # the mask for every layer's rows
    total = weights.sum().clamp_min(1.0)
    share = (assigned * weights[:, None, None]).sum(0) / total  # [k, experts]
    mean_prob = (probs * weights[:, None]).sum(0) / total
    loss = (share * mean_prob.unsqueeze(0)).sum() * num_experts
    counts = (assigned.detach() * weights[:, None, None]).view(layers, -1, num_experts).sum(1)
    return loss, counts.double()


def load_summary(counts: torch.Tensor) -> dict[str, Any]:
    """Metrics from summed counts ``[layers, experts]``: each layer's share of assignments per expert
    (``expert_load``), its imbalance (the busiest expert's share x experts: 1.0 is perfectly even,
    ``experts`` is one expert taking everything) and the largest imbalance over the layers."""
    shares = counts / counts.sum(-1, keepdim=True).clamp_min(1.0)
    imbalance = shares.max(-1).values * counts.shape[-1]
    return {
        "expert_imbalance": float(imbalance.max()),
        "expert_imbalance_per_layer": [round(float(x), 4) for x in imbalance],
        "expert_load": [[round(float(x), 4) for x in row] for row in shares],
    }


class RoutingRecorder:
    """Records router logits during training forwards (hooks on every router), and turns them into the
    load-balancing loss of the micro-batch and the running expert counts.

    Only forwards inside :meth:`recording` with gradients enabled are kept: the DPO reference pass, evaluation
    and the recomputation of checkpointed layers in backward are not training forwards of the policy."""

    def __init__(self, model: torch.nn.Module, facts: MoEFacts, coefficient: float) -> None:
        found = router_class(model)
        if found is None:
            raise ValueError(f"{type(model).__name__} declares no router module for router_logits")
        router, self._index = found
        self.facts = facts
        self.coefficient = coefficient
        self._logits: list[torch.Tensor] = []
        self._active = False
        self.counts: torch.Tensor | None = None  # [layers, experts] since the last report
        self._handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, router)
        ]
        if not self._handles:
            raise ValueError(f"{type(model).__name__} has no {router.__name__} module")

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._active and torch.is_grad_enabled():
            self._logits.append(output[self._index] if isinstance(output, tuple) else output)

    @contextmanager
    def recording(self) -> Iterator[None]:
        self._logits.clear()
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def take_loss(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """The load-balancing loss of what was recorded (None when nothing was), counting the recorded tokens
        into :attr:`counts`. Padding (``attention_mask`` 0) is left out when the mask covers the tokens."""
        logits, self._logits = self._logits, []
        if not logits:
            return None
        mask = batch.get("attention_mask")
        mask = mask.reshape(-1).bool() if mask is not None and mask.numel() == logits[0].shape[0] else None
        loss, counts = routing_statistics(logits, self.facts.top_k, mask)
        self.counts = counts if self.counts is None else self.counts + counts.to(self.counts.device)
        return loss

    def take_counts(self) -> torch.Tensor:
        """The counts since the last call (zeros ``[layers, experts]`` when none), then reset."""
        counts = self.counts
        self.counts = None
        if counts is None:
            return torch.zeros(self.layers, self.facts.num_experts, dtype=torch.float64)
        return counts.cpu()

    @property
    def layers(self) -> int:
        return len(self._handles)

    # ---- the loop's step extra (posttrain.training.extras.StepExtra)

    def micro_batch(
        self, batch: dict[str, Any], micro_batches: int
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The router loss, weighted by the coefficient and averaged over the step's micro-batches (DeepSpeed
        averages over the ranks), added to the objective; its unweighted value summed for the report."""
        loss = self.take_loss(batch)
        if loss is None:
            return None, {}
        term = loss * (self.coefficient / micro_batches) if self.coefficient > 0 else None
        return term, {"router_aux_loss": loss.detach()}

    def step_values(self, sums: dict[str, float], micro_batches: int, report: bool) -> dict[str, list[float]]:
        """The router loss summed over micro-batches, their number, and at the metrics interval the expert
        counts since the last report."""
        values = {"router_aux_loss": [sums.get("router_aux_loss", 0.0), float(micro_batches)]}
        if report:
            values["expert_counts"] = self.take_counts().flatten().tolist()
        return values

    def metrics(self, reduced: dict[str, list[float]], report: bool) -> dict[str, Any]:
        """``router_aux_loss`` (mean over the step's micro-batches and ranks) and, when counted, the load."""
        total, micro_batches = reduced["router_aux_loss"]
        metrics: dict[str, Any] = {"router_aux_loss": total / max(micro_batches, 1.0)}
        if "expert_counts" in reduced:
            counts = torch.tensor(reduced["expert_counts"], dtype=torch.float64).view(self.layers, -1)
            metrics.update(load_summary(counts))
        return metrics

    def describe(self) -> str:
        return (
            f"mixture of experts: {self.facts.num_experts} experts per layer in {self.layers} layers, "
            f"{self.facts.top_k} per token; router loss x {self.coefficient:g} added to the training "
            "loss (router_aux_loss), expert load at the metrics interval"
        )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def routing_recorder(model: torch.nn.Module, moe: MoEFacts | None, aux_loss_coef: float | None) -> Any:
    """A :class:`RoutingRecorder` on the model's routers (None for a dense model), weighting the router loss
    with ``aux_loss_coef`` (None: the model's own coefficient)."""
    if moe is None:
        return None
    coefficient = moe.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return RoutingRecorder(model, moe, coefficient)


def router_extra(module: torch.nn.Module, facts: Any, config: TrainerConfig) -> RoutingRecorder | None:
    """Step extra: a mixture of experts' router loss and expert load (None for a dense model)."""
    from posttrain.models.token_logps import unwrap

    return routing_recorder(unwrap(module), facts.moe, config.model.router_aux_loss_coef)
