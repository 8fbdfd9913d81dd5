"""Nothing the loop keeps grows with the number of steps."""

from __future__ import annotations

from posttrain.training.loop import LoopState


def test_loop_history_keeps_only_recent_records() -> None:
    state = LoopState()
    for step in range(10_000):
        state.history.append({"iter": step})
    assert len(state.history) <= 2 * state.history.limit
    assert state.history[-1]["iter"] == 9_999 and state.history[-state.history.limit]["iter"] == 9_000


def test_step_values_are_read_back_by_name() -> None:
    import torch

    from posttrain.dist import DistInfo, all_reduce_named

    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    values = {"loss": [2.5], "stops": [0.0, 1.0, 0.0], "expert_counts": [3.0, 4.0]}
    assert all_reduce_named(values, info) == values
