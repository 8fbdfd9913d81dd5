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


def test_train_iters_beyond_one_epoch(base_config) -> None:
    # 16 steps per epoch: train_iters=20 runs 20 steps over 2 epochs when epochs is left out
    result = train(merge(base_config, train_iters=20))
    assert result.state.step == 20 and result.state.epoch == 1
    # set explicitly, epochs wins: the run (and its schedule) ends after the epoch's 16 steps, and says so
    config = merge(
        base_config,
        train_iters=20,
        epochs=1,
        logger={"output_dir": base_config["logger"]["output_dir"] + "e"},
    )
    result = train(config)
    assert result.state.step == 16 and [line["iter"] for line in metrics(config)][-1] == 16
    log = (Path(config["logger"]["output_dir"]) / "logs" / "rank-0.log").read_text()
    assert "train_iters=20 is more than the 16 steps of epochs=1" in log


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
    # a stopped run's export is named for its step: `final` is kept for a finished run
    assert (tmp_path / "ckpt" / "global_step_1" / "model.safetensors").is_file()
    assert not (tmp_path / "ckpt" / "final").exists()
    card = (tmp_path / "ckpt" / "global_step_1" / "README.md").read_text()
    assert "1 optimizer step (stopped early: kill switch" in card
    assert not kill.exists()  # removed, so the next run starts normally


def test_sampler_reshuffles_each_epoch(base_config) -> None:
    config = merge(base_config, epochs=2, micro_batch_size=1)
    result = train(config)
    per_epoch = len(result.state.history) // 2
    first = [h["tokens"] for h in result.state.history[:per_epoch]]
    second = [h["tokens"] for h in result.state.history[per_epoch:]]
    assert sorted(first) == sorted(second) and first != second  # same samples, another order


def test_total_batch_size_and_lr_scaling(base_config) -> None:
    config = merge(
        base_config,
        total_train_batch_size=8,
        max_per_device_train_batch_size=4,
        optimizer={
            "lr": 1e-3,
            "lr_multiplier": 2,
            "lr_batch_size_scaling": "sqrt",
            "lr_reference_batch_size": 2,
        },
    )
    del config["micro_batch_size"]
    result = train(config)
    assert result.state.step == 8  # 62 samples -> 16 micro-batches of 4 -> 8 steps of 2
    assert [line["lr"] for line in metrics(config)] == pytest.approx([1e-3 * 2 * 2] * 8)  # x2, x sqrt(8/2)


def test_batch_size_rampup(base_config) -> None:
    config = merge(base_config, gradient_accumulation_steps=2, rampup_batch_size=[4, 4, 16])
    result = train(config)
    # global batch 4 (one micro-batch) for the first 16 samples, then 8: 4 + 12 / 2 = 10 steps
    assert result.state.step == 10
    tokens = [line["tokens"] for line in metrics(config)]
    assert sum(tokens[4:7]) / 3 > 1.5 * sum(tokens[:3]) / 3  # steps after the ramp hold twice the samples


def test_exit_interval_and_manual_gc(base_config) -> None:
    import gc

    config = merge(base_config, train_iters=10, exit_interval=3, manual_gc=True, manual_gc_interval=2)
    result = train(config)
    assert result.state.step == 3 and "exit_interval=3" in result.state.stop_reason
    assert gc.isenabled()  # turned back on after the run


def test_skip_train_and_eval_iters(base_config) -> None:
    split = {"data": {"train_eval_split": [0.75, 0.25]}}
    full = merge(base_config, skip_train=True, **split)
    result = train(full)
    assert result.state.step == 0
    (line,) = metrics(full)
    assert set(line) == {"iter", "epoch", "eval_loss", "eval_perplexity", "time"}
    capped = merge(full, eval_iters=1, logger={"output_dir": full["logger"]["output_dir"] + "-capped"})
    train(capped)
    (capped_line,) = metrics(capped)
    assert capped_line["eval_loss"] != pytest.approx(line["eval_loss"], abs=1e-6)  # one batch of four


def test_eval_interval_end_and_cap_while_training(base_config) -> None:
    config = merge(
        base_config, data={"train_eval_split": [0.75, 0.25]}, eval_interval=4, eval_iters=2, train_iters=6
    )
    train(config)
    evals = [line["iter"] for line in metrics(config) if "eval_loss" in line]
    assert evals == [4, 6]  # every 4 steps, then once at the end


def test_intervals_given_as_fractions_of_the_run(base_config, capsys) -> None:
    """Hugging Face's ``eval_steps: 0.5``: a share of the run's steps, resolved once the steps are known."""
    config = merge(
        base_config,
        data={"train_eval_split": [0.75, 0.25]},
        eval_interval=0.5,
        train_iters=6,
        eval_at_end=False,
    )
    train(config)
    evals = [line["iter"] for line in metrics(config) if "eval_loss" in line]
    assert evals == [3, 6]
    assert "eval_interval: 0.5 of the run's 6 steps = every 3 steps" in capsys.readouterr().out
