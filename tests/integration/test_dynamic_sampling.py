"""grpo's dynamic sampling (``dynamic_sampling``, DAPO) on the tiny model: groups without signal never reach
the loss, the batch is refilled in a fixed keyed order, the counts are recorded and drawn, and a batch whose
rounds run out keeps its filtered groups out of the loss with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dynamic_sampling_helpers import dynamic_config, write_mixed
from tests.integration.helpers import metrics, train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_mixed(tmp_path_factory.mktemp("mixed"))


def _groups(config: dict, group: int) -> dict[int, list[list[dict]]]:
    """Each logged generation's groups (lines of completions.jsonl, slot order)."""
    lines = (Path(config["logger"]["output_dir"]) / "completions.jsonl").read_text().splitlines()
    found: dict[int, list[dict]] = {}
    for line in map(json.loads, lines):
        found.setdefault(line["generation"], []).append(line)
    return {g: [rows[i : i + group] for i in range(0, len(rows), group)] for g, rows in found.items()}


def test_groups_without_signal_are_refilled_recorded_and_drawn(
    base_config: dict, mixed_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = dynamic_config(base_config, mixed_files)
    train(config)
    steps = [r for r in metrics(config) if "reward" in r]
    assert len(steps) == 3
    for record in steps:
        assert record["dynamic_sampling/masked_groups"] == 0
        # every third prompt is easy (filtered), so the first round keeps at most two thirds and refills
        assert record["dynamic_sampling/kept_share"] < 1 and record["dynamic_sampling/generation_rounds"] >= 2
        assert record["dynamic_sampling/filtered_groups"] >= 8 * (1 - record["dynamic_sampling/kept_share"])
        assert record["dynamic_sampling/extra_completions"] == 32 * (
            record["dynamic_sampling/generation_rounds"] - 1
        )
        assert record["frac_reward_zero_std"] == 0  # the trained batch: every group has a spread
    for generation, groups in _groups(config, 4).items():
        assert len(groups) == 8, generation
        for group in groups:
            assert len({line["reward"] for line in group}) > 1, (generation, group)
            assert len({line["prompt"][0]["content"] for line in group}) == 1
    # the run is a function of its config
    again = {**config, "logger": {"output_dir": str(tmp_path / "again")}}
    train(again)
    for first, second in zip(steps, [r for r in metrics(again) if "reward" in r], strict=True):
        for key in ("loss", "reward", "dynamic_sampling/generation_rounds", "num_tokens"):
            assert first[key] == second[key], key
    from posttrain.tracking.plot import plot_metrics

    plot_metrics([Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_batch_whose_rounds_run_out_keeps_its_filtered_groups_out_of_the_loss(
    base_config: dict, mixed_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = dynamic_config(base_config, mixed_files, max_num_gen_batches=1, train_iters=2)
    train(config)
    out = capsys.readouterr().out
    assert "after max_num_gen_batches=1 rounds" in out and out.count("dynamic_sampling: generated batch") == 1
    steps = [r for r in metrics(config) if "reward" in r]
    for record in steps:
        assert record["dynamic_sampling/generation_rounds"] == 1
        assert record["dynamic_sampling/masked_groups"] == record["dynamic_sampling/filtered_groups"] >= 3
        assert record["loss"] == record["loss"]  # finite: the kept groups train
