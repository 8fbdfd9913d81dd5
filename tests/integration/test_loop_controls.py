"""Loop controls: train_iters, exit_iteration(_this_run), min_iterations, overfit_first_batch, kill switch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import merge, metrics, train

pytestmark = pytest.mark.integration


def test_train_iters_and_exit_iteration(base_config) -> None:
    config = merge(base_config, train_iters=10, exit_iteration=3)
    result = train(config)
    assert result.state.step == 3 and "exit_iteration=3" in result.state.stop_reason
    lines = metrics(config)
    assert len(lines) == 3
    config = merge(
        base_config,
        train_iters=10,
        exit_iteration_this_run=2,
        logger={"output_dir": config["logger"]["output_dir"] + "2"},
    )
    assert train(config).state.step == 2


def test_epochs_and_min_iterations(base_config) -> None:
    # 64 rows, 2 dropped as too long -> 62 samples -> 16 steps of 4 per epoch
    assert train(merge(base_config, epochs=2)).state.step == 32
    config = merge(
        base_config, min_iterations=40, logger={"output_dir": base_config["logger"]["output_dir"] + "m"}
    )
    result = train(config)
    assert result.state.step >= 40


def test_overfit_first_batch_memorises(base_config) -> None:
    config = merge(base_config, overfit_first_batch=True, train_iters=30, optimizer={"lr": 5e-3})
    result = train(config)
    history = result.state.history
    assert history[0]["tokens"] == history[-1]["tokens"]  # the very same batch every step
    assert history[-1]["loss"] < 0.3 * history[0]["loss"]


def test_kill_switch_stops_cleanly_and_saves(base_config, tmp_path: Path) -> None:
    config = merge(
        base_config,
        epochs=5,
        checkpoint=[{"output_dir": str(tmp_path / "ckpt"), "save_end_of_training": True}],
    )
    kill = Path(config["logger"]["output_dir"]) / "kill-switch"
    kill.parent.mkdir(parents=True)
    kill.touch()
    result = train(config)
    assert result.state.step == 1 and "kill switch" in result.state.stop_reason
    assert (tmp_path / "ckpt" / "final" / "model.safetensors").is_file()
    assert not kill.exists()  # removed, so the next run starts normally


def test_sampler_reshuffles_each_epoch(base_config) -> None:
    config = merge(base_config, epochs=2, micro_batch_size=1)
    result = train(config)
    per_epoch = len(result.state.history) // 2
    first = [h["tokens"] for h in result.state.history[:per_epoch]]
    second = [h["tokens"] for h in result.state.history[per_epoch:]]
    assert sorted(first) == sorted(second) and first != second  # same samples, another order
