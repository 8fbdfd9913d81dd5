"""Nothing the loop keeps grows with the number of steps."""

from __future__ import annotations

from posttrain.loop import LoopState


def test_loop_history_keeps_only_recent_records() -> None:
    state = LoopState()
    for step in range(10_000):
        state.history.append({"iter": step})
    assert len(state.history) <= 2 * state.history.limit
    assert state.history[-1]["iter"] == 9_999 and state.history[-state.history.limit]["iter"] == 9_000
