"""Two CPU processes (gloo): the same update as one process with the same global batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from posttrain.testing.env import child_env

pytestmark = pytest.mark.distributed


def run_cli(config: dict, path: Path, nproc: int) -> subprocess.CompletedProcess[str]:
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", str(nproc)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env())


def test_two_processes_match_one(base_config: dict, tmp_path: Path) -> None:
    outputs = {}
    for nproc, micro in ((1, 4), (2, 2)):
        config = dict(base_config)
        config.update(
            train_iters=1,
            micro_batch_size=micro,
            # eps=1 makes Adam's first step ~ lr * g: sensitive to the gradient's scale (a wrong world-size or
            # token normalisation would show) and free of the sign(g) amplification of float noise.
            # Clipping would rescale the gradient to norm 1 and hide a scale error too.
            optimizer={"lr": 0.5, "eps": 1.0, "weight_decay": 0.0},
            deepspeed={"gradient_clipping": 0.0},
            logger={"output_dir": str(tmp_path / f"run{nproc}")},
            checkpoint=[{"output_dir": str(tmp_path / f"ckpt{nproc}"), "save_end_of_training": True}],
        )
        done = run_cli(config, tmp_path / f"run{nproc}.yaml", nproc)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs[nproc] = load_file(tmp_path / f"ckpt{nproc}" / "final" / "model.safetensors")
        lines = (tmp_path / f"run{nproc}" / "train-log-metrics.jsonl").read_text().splitlines()
        assert len(lines) == 1
        outputs[f"metrics{nproc}"] = [yaml.safe_load(line) for line in lines]
    diff = max(float((outputs[1][k] - outputs[2][k]).abs().max()) for k in outputs[1])
    assert diff < 1e-5, diff
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(base_config["model"]["name_or_path"]).state_dict()
    moved = max(float((outputs[1][k] - initial[k]).abs().max()) for k in outputs[1])
    assert moved > 1e-3, moved  # the step really changed the weights
    for one, two in zip(outputs["metrics1"], outputs["metrics2"], strict=True):
        assert one["tokens"] == two["tokens"]  # token counts summed over ranks
        assert abs(one["loss"] - two["loss"]) < 1e-5  # token-weighted loss over ranks
    assert (tmp_path / "run2" / "logs" / "rank-1.log").is_file()  # file_output_ranks: "*"
    assert not torch.isnan(next(iter(outputs[2].values()))).any()
