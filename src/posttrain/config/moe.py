"""Every check of mixture-of-experts training in one place: the pure ones on the config (run at validation)
and the ones that need the model's facts (whether it is a mixture of experts, its experts per layer), run
when the model's config is known, before any weight is read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from posttrain.config.base import Problem
from posttrain.config.deepspeed_block import offload_device
from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.config.trainer import TrainerConfig
    from posttrain.models.facts import ModelFacts
    from posttrain.models.moe import MoEFacts


def wants_grouped(arctic_moe: bool | str, expert_parallel_size: int, moe: MoEFacts | None) -> bool:
    """Whether the run uses the grouped expert-parallel implementation (``arctic_moe``)."""
    return expert_parallel_size > 1 or arctic_moe is True or (arctic_moe == "auto" and moe is not None)


def config_problems(config: TrainerConfig) -> Iterator[Problem]:
    """Settings that cannot run, pure: ArcticTraining's kernels and routing replay, and what expert
    parallelism cannot be combined with."""
    ep = config.expert_parallel_size
    if config.enable_arctic_moe_custom_optimization:
        yield Problem(
            "enable_arctic_moe_custom_optimization",
            "true needs ArcticTraining's custom CUDA kernels (a CUDA GPU and kernels posttrain does not "
            "ship); set it to false: the grouped implementation (arctic_moe) runs on PyTorch's grouped "
            "matmul, on CPU and GPU",
        )
    if config.enable_routing_replay:
        yield Problem(
            "enable_routing_replay",
            "true is refused: posttrain has no later pass to replay routing into (DPO's reference "
            "log-probabilities are computed once before training; a checkpointed layer's recomputation "
            "routes as its forward did); set it to false",
        )
    if ep == 1:
        return
    if config.arctic_moe is False and "arctic_moe" in config.model_fields_set:
        yield Problem(
            "arctic_moe",
            f"false contradicts expert_parallel_size={ep}, which runs through the grouped implementation; "
            "set arctic_moe: true or auto, or expert_parallel_size: 1",
        )
    stage = config.deepspeed.get("zero_optimization", {}).get("stage")
    if stage == 3 or (stage is None and offload_device(config.deepspeed, "param") != "none"):
        yield Problem(
            "deepspeed.zero_optimization.stage",
            f"3 (set, or implied by offload_param) cannot run with expert_parallel_size={ep} (DeepSpeed's "
            "ZeRO-3 does not partition expert-parallel parameters); use stage 0, 1 or 2",
        )
    others = (
        ("sequence_parallel_size", config.sequence_parallel_size > 1, "set sequence_parallel_size: 1"),
        ("model.compile", config.model.compile, "set model.compile: false"),
    )
    for key, active, fix in others:
        if active:
            yield Problem(key, f"cannot be combined with expert_parallel_size={ep} yet; {fix}")


def check_model(config: TrainerConfig, facts: ModelFacts, world_size: int) -> None:
    """What the model allows: experts to shard, their count against ``expert_parallel_size``, MoE-only keys
    on a dense model, MoE with sequence parallelism."""
    moe, architecture = facts.moe, facts.architecture
    arctic_moe, ep, sp = config.arctic_moe, config.expert_parallel_size, config.sequence_parallel_size
    aux_loss_coef = config.model.router_aux_loss_coef
    experts_implementation = config.model.experts_implementation
    problems = []
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
