"""Environment for child processes started by tests and tools."""

from __future__ import annotations

import os

RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the rank variables an in-process run set (a child must start its
    own process group, not join this one), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(extra)
    return env


def worker_cores() -> set[int]:
    """This pytest-xdist worker's share of the cores this process may use (``gw0`` the first share, ``gw1``
    the next, ...): all of them outside xdist or when there are fewer cores than workers."""
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if workers < 2 or len(cores) < workers or not worker.startswith("gw"):
        return set(cores)
    share = len(cores) // workers
    index = int(worker[2:]) % workers
    return set(cores[index * share : (index + 1) * share])
