"""The memory plan end to end: ``posttrain preprocess`` prints it (and ``--json`` gives it as data) for the
detected or a described machine; ``train`` stops before loading when the host cannot hold the model states
(an 8B config.json with no weights: nothing is read), and ``check_memory: false`` turns the check off; the
estimate stays within 20% of the measured peak (``benchmarks/memory_plan.py --quick``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.testing.env import child_env
from tests.integration.helpers import train
from tests.memory_helpers import quick_table

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, max_position_embeddings=131072)  # fmt: skip


@pytest.fixture(scope="module")
def eight_b_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer beside a Llama-8B-shaped config.json, and no weights."""
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("8b") / "model"
    shutil.copytree(tiny_model_dir, path, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    AutoConfig.for_model("llama", vocab_size=vocab, dtype="bfloat16", **LLAMA_8B).save_pretrained(path)
    return path


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_preprocess_prints_the_plan_and_json(base_config: dict, tmp_path: Path, capsys) -> None:
    path = _write(tmp_path, base_config)
    assert main(["preprocess", str(path)]) == 0
    text = capsys.readouterr().out
    assert "memory plan (per process): world size 1, ZeRO 0, float32" in text
    assert "optimizer states" in text and "verdict: fits" in text and "machine (detected): CPU" in text
    assert main(["preprocess", str(path), "--json", "--gpu-memory", "80GiB", "--gpus-per-node", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    memory = data["memory"]
    assert data["data"]["total_steps"] > 0 and memory["settings"]["world_size"] == 2
    assert memory["machine"]["described"] and memory["fits"] == {"device": True, "host": True}
    assert memory["settings"]["stage"] == 2  # ArcticTraining's default with several processes
    parts = {item["part"] for item in memory["items"]}
    assert {"parameters", "gradients", "optimizer states", "activations", "runtime"} <= parts


def test_a_plan_that_does_not_fit_lists_the_fixes(
    eight_b_dir: Path, base_config: dict, tmp_path: Path, capsys
):
    config = {
        **base_config,
        "model": {
            "name_or_path": str(eight_b_dir),
            "dtype": "bfloat16",
            "disable_activation_checkpoint": True,
        },
        "data": {**base_config["data"], "max_length": 16384, "pack_samples": True},
        "micro_batch_size": 1,
    }
    path = _write(tmp_path, config)
    assert (
        main(
            [
                "preprocess",
                str(path),
                "--gpu-memory",
                "24GiB",
                "--host-memory",
                "1TiB",
                "--gpus-per-node",
                "8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "does NOT fit (the GPU)" in text and "machine (as described)" in text
    assert "1. model.disable_activation_checkpoint: false" in text
    assert "deepspeed.zero_optimization.stage: 3" in text
    assert "DeepSpeed's estimator, model states only" in text
    fixes = text.split("cheapest changes")[1]
    assert "... and still short" not in fixes  # 8 GPUs with ZeRO 3 hold an 8B model


def test_train_stops_before_loading_when_the_host_cannot_hold_the_states(
    eight_b_dir: Path, base_config: dict, tmp_path: Path
) -> None:
    config = {**base_config, "model": {"name_or_path": str(eight_b_dir), "dtype": "bfloat16"}}
    path = _write(tmp_path, config)
    command = [sys.executable, "-m", "posttrain", "train", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert "check_memory: the host cannot hold what this run keeps in its memory" in done.stderr
    assert "optimizer states" in done.stderr and "set check_memory: false" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # make test-slow (CI runs it)
def test_estimates_within_20_percent_of_the_measured_peak(tmp_path: Path) -> None:
    rows, printed = quick_table(tmp_path)
    assert len(rows) >= 6
    assert not [row for row in rows if abs(row["error"]) > 0.20], printed


def test_train_warns_when_the_peak_is_over_and_goes_on(base_config: dict, capsys) -> None:
    # rows of up to 4M tokens would need tens of GiB of activations; the data's rows are short, so the run
    # trains after the warning
    config = {**base_config, "data": {**base_config["data"], "max_length": 4_000_000}, "train_iters": 1}
    result = train(config)
    assert result.state.step == 1
    out = capsys.readouterr().out
    assert "check_memory: the estimated peak is above what the host has" in out
    assert "`posttrain preprocess` prints the plan" in out
    train({**config, "check_memory": False})
    assert "check_memory" not in capsys.readouterr().out  # the one key turns the check off
