"""Plain console lines (logs written to a file, no terminal) carry an ETA at the run's own pace."""

from __future__ import annotations

from posttrain.tracking.metrics import MetricsFile, format_line
from posttrain.tracking.outputs import RunOutputs


def test_plain_lines_carry_an_eta_from_this_runs_pace(tmp_path) -> None:
    outputs = RunOutputs(MetricsFile(tmp_path / "m.jsonl", enabled=False), [], total_steps=10)
    # a resumed run starting at step 4: its pace is measured from its own first step
    assert outputs.eta({"iter": 4, "epoch": 0, "loss": 1.0, "time": 100.0}) is None
    assert outputs.eta({"iter": 0, "epoch": 0, "eval_loss": 1.0, "time": 101.0}) is None  # an evaluation
    eta = outputs.eta({"iter": 6, "epoch": 0, "loss": 0.9, "time": 120.0})
    assert eta == 40.0  # 10 s per step, 4 steps left
    line = format_line({"iter": 6, "epoch": 0, "loss": 0.9}, 10, eta)
    assert line == "iter 6/10 | epoch 0 | loss 0.9000 | eta 0:00:40"
    assert format_line({"iter": 6, "epoch": 0}, 10, 3725.0).endswith("eta 1:02:05")
