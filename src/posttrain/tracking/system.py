"""What a step costs: time split, memory, and estimated FLOPs (pure helpers; the loop decides when to call)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: dense bf16/fp16 tensor-core TFLOPS per device, by a substring of ``torch.cuda.get_device_name()``
PEAK_TFLOPS_16BIT = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0, "A10": 125.0}


class Timers:
    """Accumulates wall time per section within a step. With ``sync`` (a CUDA device) each boundary waits for
    the device, so the split is real rather than the time to enqueue kernels."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.sync = enabled and device.type == "cuda"
        self.totals: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - started

    def pop(self) -> dict[str, float]:
        """``time_<section>`` seconds of the step, and reset."""
        out = {f"time_{name}": value for name, value in self.totals.items()}
        self.totals = {}
        return out


def memory_metrics(device: torch.device) -> dict[str, float]:
    """GiB: process RSS on CPU; allocated, reserved and peak allocated on a CUDA device."""
    gib = 1024**3
    if device.type == "cuda":
        return {
            "memory_allocated_gib": torch.cuda.memory_allocated(device) / gib,
            "memory_reserved_gib": torch.cuda.memory_reserved(device) / gib,
            "memory_peak_gib": torch.cuda.max_memory_allocated(device) / gib,
        }
    import psutil

    return {"memory_rss_gib": psutil.Process().memory_info().rss / gib}


def peak_tflops(configured: float | None, device: torch.device, dtype: torch.dtype) -> float | None:
    """The configured peak, else the table's for a known GPU in a 16-bit dtype, else None (no MFU)."""
    if configured is not None:
        return configured
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in PEAK_TFLOPS_16BIT.items() if key in name), None)


def training_flops(parameters: int, tokens: int) -> float:
    """Estimated FLOPs of one training step: 6 x parameters x tokens (2 for the forward pass, 4 for the
    backward pass; attention's sequence-length term and recomputation are left out, so long sequences and
    activation checkpointing make this an underestimate)."""
    return 6.0 * parameters * tokens


def params_norm(model: torch.nn.Module) -> torch.Tensor:
    """Sum of squares of this rank's parameters (its ZeRO-3 partition when partitioned); the caller sums
    over ranks when partitioned and takes the square root."""
    total = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        data = getattr(param, "ds_tensor", None)
        data = param.data if data is None else data
        total += data.detach().double().pow(2).sum().cpu()
    return total


class StepMeter:
    """The per-step measurements besides loss: throughput, estimated TFLOPS and MFU, memory, time split and
    (optionally) the parameter norm."""

    def __init__(
        self,
        device: torch.device,
        timers: Timers,
        parameters: int,
        peak: float | None,
        world_size: int,
        params_norm: Any = None,
    ) -> None:
        self.device, self.timers, self.parameters, self.peak = device, timers, parameters, peak
        self.world_size, self.params_norm = world_size, params_norm

    def measure(self, samples: int, input_tokens: int, elapsed: float) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        if elapsed > 0:
            out["samples_per_second"] = samples / elapsed
            tflops = training_flops(self.parameters, input_tokens) / elapsed / 1e12 / self.world_size
            out["tflops"] = tflops  # per device
            if self.peak:
                out["mfu"] = tflops / self.peak
        out.update(memory_metrics(self.device))
        out.update(self.timers.pop())
        if self.params_norm is not None:
            out["params_norm"] = self.params_norm()
        return out
