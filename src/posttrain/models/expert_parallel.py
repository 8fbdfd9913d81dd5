"""Expert parallelism (``expert_parallel_size``, ``arctic_moe``): each MoE layer's experts sharded over a
group of ranks, tokens dispatched to them with all-to-all.

transformers keeps a layer's experts as one module holding 3-D weights (``gate_up_proj [experts, ...]``,
``down_proj``, biases for gpt-oss) whose ``forward(hidden, top_k_index, top_k_weights)`` runs the experts
grouped. Expert parallelism keeps that module, its parameter names and its own grouped computation; it
only

- slices its weights to this rank's contiguous block of ``experts / E`` experts (rank ``r`` of the group
  holds experts ``r * n .. (r + 1) * n - 1``), and
- wraps its forward: every (token, expert) assignment is sent to the rank holding the expert
  (``all_to_all_single`` with the per-rank counts), that rank runs the module's own forward on what it
  received (each row with its one expert and weight 1), the results come back the same way, and the
  routing weights are applied and summed over the top-k here, as the unsharded module does.

DeepSpeed gets the layout it reduces by: its expert-parallel process groups (``ep_size_<E>``), the
expert weights marked as expert parameters of that group (their gradients are reduced over the ranks that
hold the same experts, everything else over all ranks), a parameter-free :class:`ExpertParallelMarker`
(a ``deepspeed.moe.layer.MoE``) that tells the engine the model has MoE layers, and optimizer parameter
groups split by :func:`expert_group_name` (``optim.adamw.param_groups``).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.config import moe as moe_checks
from posttrain.config.trainer import TrainerConfig
from posttrain.errors import UserError
from posttrain.logs import say

#: the expert weights transformers' fused experts modules hold (3-D, experts first), biases included
EXPERT_WEIGHTS = (
    "gate_up_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj_bias",
    "up_proj_bias",
    "down_proj_bias",
)
#: attribute set on expert parameters: DeepSpeed's sign of an expert-parallel parameter is ``allreduce=False``
GROUP_ATTRIBUTE = "group_name"


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank sits: ``size`` ranks share each layer's ``num_experts`` experts, ``rank`` holds
    experts ``first .. first + local - 1``."""

    size: int
    rank: int
    num_experts: int
    group_name: str
    group: Any  # the torch process group of the ranks that split the experts

    def __deepcopy__(self, memo: dict) -> ExpertLayout:
        return self  # immutable, and its process group cannot be copied

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.local


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The fused experts modules of a model (transformers' ``use_experts_implementation`` layout)."""
    found = []
    for name, module in model.named_modules():
        weights = [getattr(module, w, None) for w in ("gate_up_proj", "up_proj")]
        if hasattr(module, "has_gate") and any(
            isinstance(w, torch.nn.Parameter) and w.ndim == 3 for w in weights
        ):
            found.append((name, module))
    return found


def expert_group_name(param: torch.nn.Parameter) -> str | None:
    """The expert-parallel group a parameter belongs to (None: an ordinary, replicated parameter)."""
    if getattr(param, "allreduce", True) is False:
        return getattr(param, GROUP_ATTRIBUTE, None)
    return None


def check_expert_parallel(model: torch.nn.Module, size: int) -> None:
    """Refuse models whose experts cannot be sharded, naming the classes and what to change."""
    modules = experts_modules(model)
    name = type(model).__name__
    if not modules:
        raise UserError(
            f"{name} has no fused experts module (transformers' use_experts_implementation layout, 3-D "
            "gate_up_proj/down_proj weights), so its experts cannot be sharded; set expert_parallel_size: 1 "
            "and arctic_moe: false"
        )
    for path, module in modules:
        if path.endswith("base_layer") or any("lora_" in n for n, _ in module.named_parameters()):
            raise UserError(
                f"LoRA on the expert weights ({path}, {type(module).__name__}) cannot be combined with "
                f"expert_parallel_size={size}; leave the experts out of peft_config (attention and router "
                "targets work) or set expert_parallel_size: 1"
            )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    import torch.distributed as dist

    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


def _exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """``counts[d, e]``: rows this rank sends to rank ``d``'s local expert ``e``; returns ``[s, e]``: rows
    rank ``s`` sends to this rank's local expert ``e``."""
    import torch.distributed as dist

    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def sharded_forward(
    local_forward: Any,
    layout: ExpertLayout,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts' output for ``hidden [tokens, hidden]`` routed to ``top_k_index [tokens, k]`` with
    ``top_k_weights``, computed by the ranks that hold the experts. A group of one holds every expert: the
    module's own forward, with nothing to dispatch."""
    if layout.size == 1:
        return local_forward(hidden, top_k_index, top_k_weights)
    tokens, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    order = torch.argsort(expert, stable=True)  # assignments by expert, so by destination rank
    rows = hidden[order // k]
    counts = torch.bincount(expert, minlength=layout.num_experts).view(layout.size, layout.local)
    received_counts = _exchange_counts(counts, layout.group)  # [source rank, local expert]
    in_splits = counts.sum(1).tolist()
    out_splits = received_counts.sum(1).tolist()
    received = _AllToAll.apply(rows, out_splits, in_splits, layout.group)
    local_expert = torch.arange(layout.local, device=hidden.device).repeat(layout.size)
    local_expert = local_expert.repeat_interleave(received_counts.flatten())
    ones = torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype, device=hidden.device)
    computed = local_forward(received, local_expert.unsqueeze(1), ones)  # each row: its expert's output
    returned = _AllToAll.apply(computed, in_splits, out_splits, layout.group)
    by_assignment = torch.empty_like(returned)
    by_assignment[order] = returned  # back to (token, k) order
    weighted = by_assignment.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(1).to(hidden.dtype)


def _shard(module: torch.nn.Module, layout: ExpertLayout) -> None:
    """Keep this rank's experts of every expert weight; mark them as DeepSpeed expert parameters."""
    for name in EXPERT_WEIGHTS:
        full = getattr(module, name, None)
        if not isinstance(full, torch.nn.Parameter):
            continue
        if full.shape[0] != layout.num_experts:
            raise UserError(
                f"{type(module).__name__}.{name} has {full.shape[0]} experts in its first dimension, expected "
                f"{layout.num_experts}; this experts layout cannot be sharded (set expert_parallel_size: 1)"
            )
        local = torch.nn.Parameter(
            full.data[layout.first : layout.first + layout.local].clone(), requires_grad=full.requires_grad
        )
        local.allreduce = False  # type: ignore[attr-defined]
        setattr(local, GROUP_ATTRIBUTE, layout.group_name)
        setattr(module, name, local)
    module.num_experts = layout.local  # what the module's own forward loops or groups over


def _dispatching_forward(
    self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The sharded experts module's ``forward``: the class's own forward runs on what this rank received."""
    local_forward = type(self).forward.__get__(self)
    return sharded_forward(local_forward, self.expert_parallel, hidden, top_k_index, top_k_weights)


def _marker_class() -> type:
    from deepspeed.moe.layer import MoE

    class ExpertParallelMarker(MoE):  # type: ignore[misc]
        """Parameter-free: makes DeepSpeed's engine take its MoE path (expert-parallel groups for the
        gradient reduction, ZeRO partitions and optimizer state per expert-parallel rank). The experts'
        weights are checkpointed by posttrain (``checkpoint.deepspeed``), so DeepSpeed's per-expert files
        are left empty (``num_local_experts = 0``)."""

        def __init__(self, layout: ExpertLayout) -> None:
            torch.nn.Module.__init__(self)
            self.num_experts = layout.num_experts
            self.ep_size = layout.size
            self.expert_group_name = layout.group_name
            self.num_local_experts = 0

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            """The engine asks every MoE layer to create its process groups: :func:`expert_layout` did."""

        def forward(self, *args: Any, **kwargs: Any) -> Any:  # never called
            raise RuntimeError("ExpertParallelMarker is a marker, not a layer")

    return ExpertParallelMarker


def expert_layout(size: int, num_experts: int) -> ExpertLayout:
    """DeepSpeed's expert-parallel groups of ``size`` ranks (created once), and this rank's place in them."""
    from deepspeed.utils import groups

    name = f"ep_size_{size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size, use_data_before_expert_parallel_=False)
    return ExpertLayout(
        size=size,
        rank=groups._get_expert_parallel_rank(name),
        num_experts=num_experts,
        group_name=name,
        group=groups._get_expert_parallel_group(name),
    )


def install_expert_parallel(model: torch.nn.Module, size: int, num_experts: int) -> ExpertLayout:
    """Shard every experts module of ``model`` over groups of ``size`` ranks (see the module docstring)."""
    check_expert_parallel(model, size)
    layout = expert_layout(size, num_experts)
    marker = _marker_class()
    for _, module in experts_modules(model):
        _shard(module, layout)
        module.expert_parallel = layout
        module.forward = types.MethodType(_dispatching_forward, module)  # type: ignore[method-assign]
    if any(expert_group_name(p) is not None and p.requires_grad for p in model.parameters()):
        # frozen experts (LoRA elsewhere) have no gradients to reduce: DeepSpeed's MoE path needs none
        model.expert_parallel_marker = marker(layout)
    return layout


def sharded_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules :func:`install_expert_parallel` sharded (their ``expert_parallel`` layout)."""
    return [m for m in model.modules() if isinstance(getattr(m, "expert_parallel", None), ExpertLayout)]


def installed_layout(model: torch.nn.Module) -> ExpertLayout | None:
    """The expert layout installed on ``model`` (None: experts not sharded)."""
    sharded = sharded_modules(model)
    return sharded[0].expert_parallel if sharded else None


def gather_experts(tensor: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The full ``[num_experts, ...]`` tensor from every rank's block (a collective over the group)."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(layout.size)]
    dist.all_gather(parts, tensor.contiguous(), group=layout.group)
    return torch.cat(parts)


@contextmanager
def full_experts(model: torch.nn.Module) -> Iterator[None]:
    """For the duration, every experts module holds all experts (gathered from the group, every rank takes
    part), in the model's own layout and names, so ``save_pretrained`` writes a checkpoint
    ``from_pretrained`` loads unsharded. The rank's own shards are back afterwards."""
    sharded = sharded_modules(model)
    kept: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for module in sharded:
            layout = module.expert_parallel
            for name in EXPERT_WEIGHTS:
                local = module._parameters.get(name)
                if local is None:
                    continue
                kept.append((module, name, local))
                module._parameters[name] = torch.nn.Parameter(
                    gather_experts(local.detach(), layout), requires_grad=False
                )
            module.num_experts = layout.num_experts
        yield
    finally:
        for module, name, local in kept:
            module._parameters[name] = local
        for module in sharded:
            module.num_experts = module.expert_parallel.local


def expert_parallel_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: MoE layers run grouped (``arctic_moe``), their experts sharded over
    ``expert_parallel_size`` processes."""
    moe = facts.moe
    if moe is None or not moe_checks.wants_grouped(config.arctic_moe, config.expert_parallel_size, moe):
        return model
    from posttrain.models.token_logps import unwrap

    layout = install_expert_parallel(unwrap(model), config.expert_parallel_size, moe.num_experts)
    say(
        f"MoE layers run grouped: {moe.num_experts} experts per layer, {layout.local} on each of "
        f"{layout.size} expert-parallel processes"
    )
    return model


class ExpertWeights:
    """Each rank's experts, saved and loaded beside DeepSpeed's checkpoint (its model file holds rank 0's
    only; the optimizer state is per expert-parallel rank already): the engine's ``rank_state``."""

    def _weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p for n, p in module.named_parameters() if expert_group_name(p) is not None}

    def _file(self, directory: str) -> str:
        import os

        import torch.distributed as dist

        return os.path.join(directory, f"experts_rank{dist.get_rank()}.pt")

    def save(self, module: torch.nn.Module, directory: str) -> None:
        torch.save({name: p.detach() for name, p in self._weights(module).items()}, self._file(directory))

    def load(self, module: torch.nn.Module, directory: str) -> None:
        saved = torch.load(self._file(directory), map_location="cpu", weights_only=True)
        with torch.no_grad():
            for name, param in self._weights(module).items():
                param.copy_(saved[name])


def is_expert_parameter(param: torch.nn.Parameter) -> bool:
    return expert_group_name(param) is not None
