"""A run in a folder an earlier run used: its records are its own (the earlier ones moved aside, said), and a
setting the run does not honour (``epochs`` under a smaller ``train_iters``) is said in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.helpers import train

pytestmark = pytest.mark.integration


def test_a_new_run_in_a_used_folder_keeps_its_records_apart(
    base_config: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**base_config, "train_iters": 3, "epochs": 2}
    train(config)
    said = capsys.readouterr()
    assert (
        "epochs=2 is not honoured: train_iters=3 ends the run after 3 of their 32 steps"
        in said.out + said.err
    )
    metrics = Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"
    first = metrics.read_text()
    train({**base_config, "train_iters": 2})
    said = capsys.readouterr()
    steps = [json.loads(line)["iter"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2]  # the second run's own, not appended to the first's
    [aside] = (metrics.parent / "earlier-runs").iterdir()
    assert (aside / "train-log-metrics.jsonl").read_text() == first  # moved, not lost
    assert f"held an earlier run's records (train-log-metrics.jsonl): moved to {aside}" in said.out + said.err
