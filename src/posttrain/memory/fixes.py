"""The cheapest changes that make a plan fit, in the order an engineer would try them: activation
checkpointing, tiled loss and MLP (recomputation, no communication), a higher ZeRO stage (more communication),
offload (host memory and PCIe traffic), a higher sequence-parallel degree (more GPUs per sample), a smaller
micro-batch (more accumulation steps, same global batch). Each is applied on top of the ones before until
the plan fits; each is reported with the memory it gives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from posttrain.memory.estimate import MemoryPlan, Settings, plan
from posttrain.memory.machine import Machine
from posttrain.memory.shape import ModelShape

Step = tuple[Settings, str]


@dataclass(frozen=True)
class Fix:
    change: str  # the config keys to set, as the user writes them
    plan: MemoryPlan  # the plan with this change and every one before it
    device_saved: float
    host_saved: float


def fits(memory: MemoryPlan, machine: Machine) -> tuple[bool, bool]:
    """(the device holds a process's peak, the host holds the peaks of all its processes)."""
    device = machine.device != "cuda" or machine.device_memory is None
    device = device or memory.device_peak <= machine.device_memory  # type: ignore[operator]
    host = memory.host_peak * machine.processes_per_node <= machine.host_memory
    return device, host


def _checkpointing(s: Settings, shape: ModelShape, machine: Machine) -> Iterator[Step]:
    if not s.checkpointing:
        yield replace(s, checkpointing=True), "model.disable_activation_checkpoint: false"


def _tiling(s: Settings, shape: ModelShape, machine: Machine) -> Iterator[Step]:
    if not s.loss_tiled:
        yield replace(s, tiled_loss=True), "tiled_loss_compute: true"
    if not s.tiled_mlp and shape.gated and not shape.num_experts:
        yield replace(s, tiled_mlp=True), "tiled_mlp_compute: true"


def _zero(s: Settings, shape: ModelShape, machine: Machine) -> Iterator[Step]:
    for stage in range(max(s.stage, 1) + 1, 4):
        if s.world_size > 1:
            s = replace(s, stage=stage)
            yield s, f"deepspeed.zero_optimization.stage: {stage}"


def _offload(s: Settings, shape: ModelShape, machine: Machine) -> Iterator[Step]:
    if s.offload_optimizer == "none":
        s = replace(s, offload_optimizer="cpu", optimizer="cpu_adam", stage=max(s.stage, 2))
        yield s, "deepspeed.zero_optimization.offload_optimizer.device: cpu (optimizer.type: cpu_adam)"
    if s.offload_param == "none":
        s = replace(s, offload_param="cpu", stage=3)
        yield s, "deepspeed.zero_optimization.offload_param.device: cpu (ZeRO stage 3)"
    if s.checkpointing and not s.checkpoint_offload and s.device == "cuda":
        yield replace(s, checkpoint_offload=True), "activation_checkpoint_cpu_offload: true"


def _sequence_parallel(s: Settings, shape: ModelShape, machine: Machine) -> Iterator[Step]:
    degree = s.sequence_parallel * 2
    while degree <= machine.processes_per_node and s.world_size % degree == 0 and shape.heads % degree == 0:
        s = replace(s, sequence_parallel=degree)
        yield s, f"sequence_parallel_size: {degree}"
        degree *= 2


def _micro_batch(s: Settings, shape: ModelShape, machine: Machine) -> Iterator[Step]:
    while s.micro_batch > 1 and s.micro_batch % 2 == 0:
        s = replace(s, micro_batch=s.micro_batch // 2, gradient_accumulation=s.gradient_accumulation * 2)
        yield s, f"micro_batch_size: {s.micro_batch} (gradient_accumulation_steps: {s.gradient_accumulation})"


def _to_disk(s: Settings, shape: ModelShape, machine: Machine) -> Iterator[Step]:
    """When the host is what overflows: keep the offloaded states on NVMe instead."""
    if s.offload_optimizer == "cpu":
        s = replace(s, offload_optimizer="nvme")
        yield s, "deepspeed.zero_optimization.offload_optimizer.device: nvme (with nvme_path)"
    if s.offload_param == "cpu":
        s = replace(s, offload_param="nvme")
        yield s, "deepspeed.zero_optimization.offload_param.device: nvme (with nvme_path)"
    if s.checkpoint_offload:
        yield replace(s, checkpoint_offload=False), "activation_checkpoint_cpu_offload: false"


STEPS: tuple[Callable[[Settings, ModelShape, Machine], Iterator[Step]], ...] = (
    _checkpointing,
    _tiling,
    _zero,
    _offload,
    _sequence_parallel,
    _micro_batch,
)


def cheapest_fixes(memory: MemoryPlan, machine: Machine) -> tuple[list[Fix], bool]:
    """The changes, in order, that make ``memory`` fit ``machine``, and whether the last one does. A change
    that saves nothing where memory is short is skipped."""
    device_ok, host_ok = fits(memory, machine)
    if device_ok and host_ok:
        return [], True
    steps = (*STEPS, _to_disk) if not device_ok else (_to_disk,)  # (only the host overflows)
    fixes: list[Fix] = []
    current = memory
    for step in steps:
        for settings, change in step(current.settings, current.shape, machine):
            candidate = plan(settings, current.shape)
            device_saved = current.device_peak - candidate.device_peak
            host_saved = current.host_peak - candidate.host_peak
            useful = device_saved > 0 if not fits(current, machine)[0] else host_saved > 0
            if not useful:
                continue
            fixes.append(Fix(change, candidate, device_saved, host_saved))
            current = candidate
            if all(fits(current, machine)):
                return fixes, True
    return fixes, False
