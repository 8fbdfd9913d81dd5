"""What a machine has: its accelerator memory, its host memory and how many processes share a host, found on
this machine or described on the command line (``--gpu-memory 80GiB --host-memory 512GiB --gpus-per-node 8``)
to plan for one you are not on."""

from __future__ import annotations

import re
from dataclasses import dataclass

from posttrain.errors import UserError

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_size(text: str, flag: str) -> float:
    """Bytes from ``80GiB``, ``80GB``, ``80G`` (binary, as ``free -g`` prints) or a plain byte count."""
    match = _SIZE.match(text)
    unit = match["unit"].lower() if match else ""
    if match is None or unit not in UNITS:
        raise UserError(
            f"{flag} {text!r}: not a memory size; write a number and a unit, e.g. 80GiB, 80GB or 512G "
            "(KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB powers of 10, a bare K/M/G/T is binary)"
        )
    return float(match["number"]) * UNITS[unit]


@dataclass(frozen=True)
class Machine:
    """``device``: ``cuda`` or ``cpu`` (a CPU run keeps everything in host memory). ``processes_per_node``:
    how many training processes share one host's memory. ``described``: from the command line."""

    device: str
    device_memory: float | None  # bytes per GPU (None on CPU)
    host_memory: float  # bytes one host can give the run
    processes_per_node: int
    name: str = ""
    described: bool = False


def detect(processes_per_node: int) -> Machine:
    """This machine: the first GPU's total memory and the host memory available now."""
    import psutil
    import torch

    host = float(psutil.virtual_memory().available)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        return Machine("cuda", float(props.total_memory), host, processes_per_node, f"{props.name} x {count}")
    return Machine("cpu", None, host, processes_per_node, "CPU")


def described(
    gpu_memory: str | None, host_memory: str | None, gpus_per_node: int | None, world_size: int
) -> Machine | None:
    """A machine from the command line's flags, the rest taken from this one; None when no flag is given."""
    if gpu_memory is None and host_memory is None and gpus_per_node is None:
        return None
    if gpus_per_node is not None and gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {gpus_per_node}: must be >= 1")
    here = detect(min(world_size, gpus_per_node or world_size))
    device = "cuda" if gpu_memory is not None else here.device
    return Machine(
        device=device,
        device_memory=parse_size(gpu_memory, "--gpu-memory") if gpu_memory else here.device_memory,
        host_memory=parse_size(host_memory, "--host-memory") if host_memory else here.host_memory,
        processes_per_node=min(world_size, gpus_per_node or world_size),
        name="GPUs" if device == "cuda" else here.name,
        described=True,
    )
