"""The ``harness:`` block on a GPU (run on a machine with one): lm-evaluation-harness tasks on the CUDA model
being trained, a log-likelihood task and a generation task, the end value what ``posttrain eval`` gives on the
run's export, and the losses those of the run without the block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.helpers import merge, metrics, train
from tests.integration.test_harness import DATA, TASK
from tests.integration.test_harness_training import DIGITS

pytestmark = pytest.mark.gpu
pytest.importorskip("lm_eval")


def test_harness_tasks_on_the_cuda_model_being_trained(
    base_config: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from posttrain.cli import main

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "reverse_choice.yaml").write_text(TASK.format(data=DATA))
    (tasks / "reverse_digits_few.yaml").write_text(DIGITS.format(data=DATA))
    harness = {"tasks": ["reverse_choice", "reverse_digits_few"], "include_path": str(tasks), "interval": 2}
    runs = {}
    for name, changes in (("with", {"harness": {**harness, "limit": 16, "batch_size": 4}}), ("without", {})):
        out = tmp_path / name
        export = {"type": "huggingface", "output_dir": str(out / "export"), "save_end_of_training": True}
        config = merge(
            base_config, train_iters=4, logger={"output_dir": str(out)}, checkpoint=[export], **changes
        )
        train(config)
        runs[name] = {line["iter"]: line for line in metrics(config)}
    assert torch.cuda.is_available()
    last = runs["with"][4]
    assert 0 <= last["eval/reverse_choice/acc"] <= 1 and last["time_harness"] > 0
    assert "eval/reverse_digits_few/exact_match" in last and "eval/reverse_choice/acc" in runs["with"][2]
    for step in range(1, 5):
        assert runs["with"][step]["loss"] == runs["without"][step]["loss"], step
    export = next((tmp_path / "with" / "export").glob("*"))
    options = [
        "--tasks",
        "reverse_choice",
        "--include-path",
        str(tasks),
        "--limit",
        "16",
        "--batch-size",
        "4",
    ]
    capsys.readouterr()  # the runs' own lines
    assert main(["eval", str(export), *options, "--json"]) == 0
    after = json.loads(capsys.readouterr().out)["results"]["reverse_choice"]["acc,none"]
    assert after == pytest.approx(
        last["eval/reverse_choice/acc"], abs=1 / 16
    )  # bf16/TF32 kernels may flip one
