"""Process-group set-up and the few collectives the loop needs (world size 1 skips them all)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as torch_dist

from posttrain.utils.imports import accelerator, import_deepspeed


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


#: ports to hand out, ``LO-HI``, instead of the system's: processes that run side by side (test workers) each
#: take a range of their own outside the system's ephemeral ports, so that a port chosen for a server that
#: is still starting is never one another process (or another engine's own sockets) takes meanwhile
PORT_RANGE = "POSTTRAIN_PORT_RANGE"
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port nothing listens on now: the system's choice, or under ``POSTTRAIN_PORT_RANGE`` one of that
    range this process has not handed out before (from a place in it that depends on the process)."""
    span = os.environ.get(PORT_RANGE, "")
    if span:
        low, high = (int(end) for end in span.split("-"))
        width = high - low + 1
        for step in range(width):
            port = low + (os.getpid() * 7919 + step) % width
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_rank_env() -> None:
    """A process started without a launcher gets the env of rank 0 of 1 (else DeepSpeed tries MPI)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        return
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
    )


def init_distributed() -> DistInfo:
    """Start the process group (nccl on GPU, gloo on CPU) through DeepSpeed's comm layer."""
    ensure_rank_env()
    import importlib

    deepspeed = import_deepspeed()
    # `import deepspeed.comm.torch as m` would bind the real torch (an attribute of deepspeed.comm).
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    if os.environ.get("POSTTRAIN_DS_SHM_COMM") != "1":
        # DeepSpeed would compile its shared-memory all-reduce op (about 30 s of gcc) at the first CPU init;
        # gloo is enough for CPU runs, so keep the default CPU run free of op compiles.
        ds_comm_torch.build_shm_op = lambda: None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if accelerator() == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not torch_dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and CUDA) generator states restored after the block."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum a few numbers over all ranks in one collective (a no-op with one process)."""
    if info.world_size == 1:
        return values
    tensor = torch.tensor(
        values, dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu"
    )
    torch_dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_named(values: dict[str, list[float]], info: DistInfo) -> dict[str, list[float]]:
    """Named lists of numbers summed over all ranks in one collective and read back by name (every rank
    passes the same names in the same order, with lists of the same lengths)."""
    flat = all_reduce_sum([x for numbers in values.values() for x in numbers], info)
    out, start = {}, 0
    for name, numbers in values.items():
        out[name] = flat[start : start + len(numbers)]
        start += len(numbers)
    return out


def exit_launched_rank() -> None:
    """End a rank that a launcher started (world size > 1) once its run is done: leave the process group after a
    barrier, flush the output, and skip the interpreter's teardown. There, gloo's threads are torn down in no
    set order and now and then abort a process whose run succeeded ("terminate called without an active
    exception", exit -6), which the launcher reports as a failed run. A lone process returns as usual."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not torch_dist.is_initialized():
        return
    torch_dist.barrier()
    torch_dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        torch_dist.barrier()


def all_gather_rows(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape on each) stacked along the first dimension in rank order (the
    tensor itself with one process)."""
    if info.world_size == 1:
        return tensor
    device = info.device if info.device.type == "cuda" else torch.device("cpu")
    local = tensor.to(device).contiguous()
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    torch_dist.all_gather(parts, local)
    return torch.cat(parts).to(tensor.device)


def all_gather_objects(value: object, info: DistInfo) -> list[object]:
    """Every rank's picklable ``value`` in rank order (``[value]`` with one process)."""
    if info.world_size == 1:
        return [value]
    everyone: list[object] = [None] * info.world_size
    torch_dist.all_gather_object(everyone, value)
    return everyone
