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
