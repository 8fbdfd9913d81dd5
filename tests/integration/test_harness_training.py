"""``harness:``: lm-evaluation-harness tasks on the model being trained, every N steps and at the end, logged as
``eval/<task>/<metric>`` with ``time_harness``; the last value is what ``posttrain eval`` gives on the run's
export; the run trains exactly as without the block; ZeRO-3 on two processes gives the one-process values; a
task that does not exist stops the run before its first step; ``posttrain plot`` draws the tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_harness import DATA, TASK
from tests.resume_helpers import cli, last_metrics

pytestmark = pytest.mark.integration
pytest.importorskip("lm_eval")

STEPS = 6
#: the demo's generation task, greedy, on a few prompts (the harness's generate path on the training model)
DIGITS = """
task: reverse_digits_few
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt[0].content}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 6
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, chat_file: Path) -> dict[str, Any]:
    """The same SFT run with the harness block, without it, and on two processes under ZeRO-3."""
    from tests.conftest import make_base_config

    root = tmp_path_factory.mktemp("harness-training")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "reverse_choice.yaml").write_text(TASK.format(data=DATA))
    (tasks / "reverse_digits_few.yaml").write_text(DIGITS.format(data=DATA))
    harness = {
        "tasks": ["reverse_choice", "reverse_digits_few"],
        "include_path": str(tasks),
        "interval": 3,
        "limit": 16,
        "batch_size": 4,
    }
    base = make_base_config(tiny_model_dir, chat_file, root)
    base.update(train_iters=STEPS, loss_log_interval=1)
    found: dict[str, Any] = {"root": root, "tasks": tasks, "base": base}
    for name, changes, nproc in (
        ("with", {"harness": harness}, 1),
        ("without", {}, 1),
        (
            "zero3",
            {"harness": harness, "deepspeed": {"zero_optimization": {"stage": 3}}, "micro_batch_size": 2},
            2,
        ),
    ):
        out = root / name
        config = {**base, **changes, "logger": {"output_dir": str(out)}}
        config["checkpoint"] = [
            {"type": "huggingface", "output_dir": str(out / "export"), "save_end_of_training": True}
        ]
        done = cli(config, root / f"{name}.yaml", nproc=nproc)
        assert done.returncode == 0, done.stderr[-4000:]
        found[name] = last_metrics(out)
        found[f"{name}_output"] = done.stdout + done.stderr
    return found


def test_tasks_are_logged_every_n_steps_and_at_the_end_and_cost_nothing_in_exactness(
    runs: dict[str, Any],
) -> None:
    with_harness, without = runs["with"], runs["without"]
    keys = ("eval/reverse_choice/acc", "eval/reverse_choice/acc_norm", "eval/reverse_digits_few/exact_match")
    for step in (3, 6):
        for key in keys:
            assert 0.0 <= with_harness[step][key] <= 1.0, (step, key)
        assert with_harness[step]["time_harness"] > 0
    assert not any(key.startswith("eval/") for key in with_harness[1])
    assert 0 < with_harness[6]["eval/reverse_choice/acc"] < 1  # a number the next test must reproduce
    for step in range(1, STEPS + 1):
        assert with_harness[step]["loss"] == without[step]["loss"], step  # the harness left the run alone
    assert (
        "harness: reverse_choice, reverse_digits_few every 3 steps and at the end, on rank 0"
        in runs["with_output"]
    )


def test_the_last_value_is_what_posttrain_eval_gives_on_the_export(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from posttrain.cli import main

    export = next((runs["root"] / "with" / "export").glob("*"))
    options = ["--tasks", "reverse_choice", "--include-path", str(runs["tasks"]), "--limit", "16"]
    assert main(["eval", str(export), *options, "--batch-size", "4", "--json"]) == 0
    after = json.loads(capsys.readouterr().out)["results"]["reverse_choice"]
    assert after["acc,none"] == runs["with"][STEPS]["eval/reverse_choice/acc"]


def test_zero3_on_two_processes_gives_the_one_process_values(runs: dict[str, Any]) -> None:
    one, two = runs["with"], runs["zero3"]
    assert "on every rank in step (ZeRO-3)" in runs["zero3_output"]
    for step in (3, 6):
        assert two[step]["eval/reverse_choice/acc"] == one[step]["eval/reverse_choice/acc"], step
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4), step  # ZeRO-3 sums apart


def test_an_unknown_task_stops_the_run_before_its_first_step(runs: dict[str, Any], tmp_path: Path) -> None:
    config = {**runs["base"], "logger": {"output_dir": str(tmp_path / "bad")}}
    config["harness"] = {"tasks": ["reverse_choise"], "include_path": str(runs["tasks"])}
    done = cli(config, tmp_path / "bad.yaml")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "harness.tasks reverse_choise: no such harness task (close: reverse_choice" in done.stderr
    assert not (tmp_path / "bad" / "train-log-metrics.jsonl").exists()


def test_posttrain_plot_draws_the_tasks(runs: dict[str, Any], tmp_path: Path) -> None:
    from posttrain.cli import main
    from posttrain.tracking.plot import harness_keys, read_metrics

    metrics = runs["root"] / "with" / "train-log-metrics.jsonl"
    assert "eval/reverse_choice/acc" in harness_keys([(metrics, read_metrics(metrics))])
    assert main(["plot", str(metrics), "--out", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").stat().st_size > 0
