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


@dataclass(frozen=True)
class MoEFacts:
    """A mixture-of-experts model's routing: experts per layer, experts per token, the load-balancing
    coefficient its config names (``router_aux_loss_coef``)."""

    num_experts: int
    top_k: int
    aux_loss_coef: float


def moe_facts_from_hf_config(config: Any) -> MoEFacts | None:
    """The routing of a transformers config, or None for a dense model."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(experts, int) or experts < 2 or not isinstance(top_k, int):
        return None
    return MoEFacts(experts, top_k, float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))


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

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def wants_grouped(arctic_moe: bool | str, expert_parallel_size: int, moe: MoEFacts | None) -> bool:
    """Whether the run uses the grouped expert-parallel implementation (``arctic_moe``)."""
    return expert_parallel_size > 1 or arctic_moe is True or (arctic_moe == "auto" and moe is not None)


def check_moe(
    moe: MoEFacts | None,
    architecture: str,
    *,
    aux_loss_coef: float | None,
    sp: int,
    arctic_moe: bool | str = False,
    expert_parallel_size: int = 1,
    world_size: int = 1,
    experts_implementation: str | None = None,
) -> None:
    """Start-up checks that need to know whether the model is a mixture of experts."""
    from posttrain.errors import UserError

    problems = []
    ep = expert_parallel_size
    if moe is None and wants_grouped(arctic_moe, ep, moe):
        key = f"expert_parallel_size={ep}" if ep > 1 else f"arctic_moe={arctic_moe}"
        problems.append(
            f"{key} shards the experts of a mixture-of-experts model and {architecture} is dense; "
            "set expert_parallel_size: 1 and arctic_moe: false (or auto)"
        )
    if moe is not None and ep > 1 and moe.num_experts % ep:
        problems.append(
            f"{architecture} has {moe.num_experts} experts per layer, not divisible by "
            f"expert_parallel_size={ep}; use a divisor of {moe.num_experts}"
        )
    if ep > 1 and world_size % ep:
        problems.append(
            f"expert_parallel_size={ep} must divide the number of processes ({world_size}); launch a "
            f"multiple of {ep} processes or change expert_parallel_size"
        )
    for key, value in (
        ("router_aux_loss_coef", aux_loss_coef),
        ("experts_implementation", experts_implementation),
    ):
        if moe is None and value is not None:
            problems.append(
                f"model.{key}={value} applies to mixture-of-experts models and {architecture} is dense; "
                "remove the key"
            )
    if moe is not None and sp > 1:
        problems.append(
            f"{architecture} is a mixture-of-experts model and sequence_parallel_size={sp} is not supported "
            "with one yet (the router loss and expert load would cover a slice of each sequence); "
            "set sequence_parallel_size: 1"
        )
    if problems:
        raise UserError("; ".join(problems))


def routing_recorder(model: torch.nn.Module, moe: MoEFacts | None, aux_loss_coef: float | None) -> Any:
    """A :class:`RoutingRecorder` on the model's routers (None for a dense model), weighting the router loss
    with ``aux_loss_coef`` (None: the model's own coefficient)."""
    if moe is None:
        return None
    coefficient = moe.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return RoutingRecorder(model, moe, coefficient)
