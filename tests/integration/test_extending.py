"""docs/extending.md's worked examples, taken from the page as they stand: a method, a model transform and a step
extra train together in one run; the command runs through the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from posttrain import registry
from posttrain.commands import COMMANDS, all_commands
from tests.integration.helpers import merge, metrics, train, weights

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def examples() -> dict[str, str]:
    """The page's code blocks whose info string names a file (```python extensions.py), joined per file."""
    files: dict[str, str] = {}
    for name, code in re.findall(r"^```\w+ (\S+)\n(.*?)^```", PAGE.read_text(), re.S | re.M):
        files[name] = files.get(name, "") + code + "\n"
    return files


@pytest.fixture
def clean_registries():
    """The examples register into process-wide tables: put them back as they were afterwards."""
    registry.load_builtins()  # the built-ins are part of what is put back
    all_commands()  # and every group's commands (registered once per process, on first use)
    saved = (
        list(registry.MODEL_TRANSFORMS._parts),
        list(registry.STEP_EXTRAS._parts),
        dict(registry.TRAINERS._entries),
        dict(COMMANDS),
    )
    yield
    registry.MODEL_TRANSFORMS._parts[:] = saved[0]
    registry.STEP_EXTRAS._parts[:] = saved[1]
    registry.TRAINERS._entries.clear()
    registry.TRAINERS._entries.update(saved[2])
    COMMANDS.clear()
    COMMANDS.update(saved[3])


def test_method_model_step_and_step_extra_from_the_page(
    base_config: dict, tmp_path: Path, clean_registries
) -> None:
    files = examples()
    assert {"extensions.py", "run.yaml", "count_params.py"} <= set(files)
    (tmp_path / "extensions.py").write_text(files["extensions.py"])
    config = merge(base_config, **yaml.safe_load(files["run.yaml"]), train_iters=4, loss_log_interval=1)
    config["code"] = str(tmp_path / "extensions.py")
    before = weights(_fresh_model(config))
    result = train(config)
    after = weights(result.model)
    records = [r for r in metrics(config) if "loss" in r]
    assert len(records) == 4
    # the method: label smoothing adds the smoothing term to every target's NLL, so the loss sits above the
    # plain NLL of the same weights; it trains
    assert all(r["loss"] > 0 for r in records) and records[-1]["loss"] < records[0]["loss"]
    # the model transform froze the embeddings, and only them
    embedding = "model.embed_tokens.weight"
    assert (after[embedding] == before[embedding]).all()
    assert any((after[n] != before[n]).any() for n in after if n != embedding)
    # the step extra: a z-loss in every record, positive
    assert all(r["z_loss"] > 0 for r in records)


def _fresh_model(config: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(config["model"]["name_or_path"], dtype="float32")


def test_command_from_the_page(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], clean_registries
) -> None:
    exec(compile(examples()["count_params.py"], "count_params.py", "exec"), {})
    from posttrain.cli import main

    assert main(["count-params", str(tiny_model_dir)]) == 0
    printed = capsys.readouterr().out
    params = sum(
        p.numel() for p in _fresh_model({"model": {"name_or_path": str(tiny_model_dir)}}).parameters()
    )
    assert f"{params:,} parameters" in printed


def test_reward_functions_from_the_page(base_config: dict, tmp_path: Path, monkeypatch) -> None:
    from tests.grpo_helpers import grpo_config, write_prompts

    files = examples()
    (tmp_path / "rewards.py").write_text(files["rewards.py"])
    monkeypatch.chdir(tmp_path)  # the page's paths are relative to where posttrain runs
    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    config = grpo_config(base_config, {"train": prompts, "reward": tmp_path / "unused.py"}, train_iters=2)
    config.update(yaml.safe_load(files["grpo.yaml"]))
    train(config)
    records = [r for r in metrics(config) if "reward" in r]
    assert len(records) == 2 and all(
        "rewards/digits_only/mean" in r and "rewards/correct/mean" in r for r in records
    )


def test_online_method_from_the_page(base_config: dict, tmp_path: Path, clean_registries) -> None:
    """The page's scored online method trains on the shared feed with the shared scorer, borrowing nothing from
    grpo: its records in every step, its completions logged with their rewards."""
    from tests.grpo_helpers import write_prompts

    files = examples()
    assert "posttrain.methods" not in files["online.py"]
    (tmp_path / "online.py").write_text(files["online.py"])
    config = merge(base_config, **yaml.safe_load(files["online.yaml"]), train_iters=3, loss_log_interval=1)
    config["code"] = str(tmp_path / "online.py")
    config["data"] = {"sources": [str(write_prompts(tmp_path / "prompts.jsonl", 32))], "max_length": 64}
    config.update(completions_log_interval=1, micro_batch_size=4, gradient_accumulation_steps=1)
    train(config)
    records = [r for r in metrics(config) if "reward" in r]
    assert len(records) == 3 and all(0.0 <= r["reward"] <= 1.0 for r in records)
    logged = Path(config["logger"]["output_dir"]) / "completions.jsonl"
    lines = [json.loads(line) for line in logged.read_text().splitlines()]
    assert len(lines) == 3 * 4 and all("regex" in line["rewards"] for line in lines)  # one prompt x 4, a step
