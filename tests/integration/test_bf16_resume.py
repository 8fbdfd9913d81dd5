"""bfloat16 checkpoints across the optimizer change: one bf16 process ran ZeRO stage 0 (the optimizer state in
bfloat16, whole, in DeepSpeed's model file) before posttrain ran it as DeepSpeed's BF16_Optimizer (stage 1, a
float32 shard file); such a checkpoint resumes as it was trained, and a checkpoint that lacks a file the engine
reads is one line, never a FileNotFoundError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import posttrain.stages.model as model_stage
from posttrain.checkpoint.layout import MARKER
from posttrain.config import deepspeed as deepspeed_config
from posttrain.errors import UserError
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration


def _before_bf16_optimizer(config: Any, *, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The DeepSpeed config one bf16 process had before BF16_Optimizer: stage 0, no accumulation dtype."""
    built = deepspeed_config.build_deepspeed_config(config, world_size=world_size, hidden_size=hidden_size)
    built["zero_optimization"]["stage"] = 0
    built.pop("data_types", None)
    return built


def _bf16(base_config: dict, tmp_path: Path, name: str, steps: int) -> dict:
    resumable = {"type": "deepspeed", "output_dir": str(tmp_path / name / "ckpt"), "auto_resume": True}
    return merge(
        base_config,
        model={"dtype": "bfloat16"},
        train_iters=steps,
        loss_log_interval=1,
        logger={"output_dir": str(tmp_path / name)},
        checkpoint=[{**resumable, "save_every_n_steps": 2}],
    )


def _losses(run: Any) -> list[float]:
    return [record["loss"] for record in run.state.history if "loss" in record]


@pytest.mark.parametrize("recorded", [True, False])
def test_a_checkpoint_from_before_bf16_optimizer_goes_on_as_it_was_trained(
    base_config: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, recorded: bool
) -> None:
    """Written at stage 0 in bf16 (``recorded``: its marker names the stage; else it predates recorded
    layouts and the files tell), resumed by today's code: the last two steps equal an uninterrupted run of
    the old settings."""
    with monkeypatch.context() as old:
        old.setattr(model_stage, "build_deepspeed_config", _before_bf16_optimizer)
        reference = _losses(train(_bf16(base_config, tmp_path, "reference", 4)))
        train(_bf16(base_config, tmp_path, "resumed", 2))
    checkpoint = tmp_path / "resumed" / "ckpt" / "global_step_2"
    assert not list(checkpoint.glob("*optim_states.pt"))  # the optimizer state is in the model file
    if not recorded:
        marker = json.loads((checkpoint / MARKER).read_text())
        del marker["zero_stage"]
        (checkpoint / MARKER).write_text(json.dumps(marker))
    capsys.readouterr()
    resumed = _losses(train(_bf16(base_config, tmp_path, "resumed", 4)))
    said = capsys.readouterr().out
    assert "written by one bfloat16 process at ZeRO stage 0" in said and "goes on as it was trained" in said
    assert resumed == reference[2:]


def test_a_checkpoint_missing_a_file_is_one_line(base_config: dict, tmp_path: Path) -> None:
    train(_bf16(base_config, tmp_path, "run", 2))
    checkpoint = tmp_path / "run" / "ckpt" / "global_step_2"
    (shard,) = checkpoint.glob("bf16_zero_pp_rank_0_*optim_states.pt")  # BF16_Optimizer's float32 state
    shard.unlink()
    with pytest.raises(UserError) as raised:
        train(_bf16(base_config, tmp_path, "run", 4))
    message = str(raised.value)
    assert f"checkpoint {checkpoint} has no {shard.name}" in message
    assert "written by 1 process(es) at ZeRO stage 1" in message and "huggingface export" in message
