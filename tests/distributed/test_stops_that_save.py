"""Stops as clusters send them, on a grpo run whose reward workers are scoring when the signal comes (issue #59
point 4): SLURM's SIGTERM to every process of the job (the command, torchrun, both ranks, the reward workers),
with a step that takes longer than torchrun's own 30 s grace. The reward workers ignore the signal and finish
the call, torchrun waits for the ranks (posttrain raises its grace), both ranks end the step, save, and the
command exits 0; the kill switch the command wrote is gone."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from posttrain.testing.env import child_env
from tests.grpo_helpers import DIGITS, grpo_config, write_prompts
from tests.integration.helpers import merge

pytestmark = pytest.mark.distributed

#: longer than torchrun's default grace (30 s): the ranks would be SIGKILLed before they save
SLOW_SCORE_S = 36

SLOW = """
import os, time

def slow_digits(completions, **kwargs):
    # once the test asks for it, every process's next call takes longer than torchrun's default grace
    if os.path.exists({flag!r}):
        mine = {flag!r} + ".scoring." + str(os.getpid())
        if not any(p.startswith(os.path.basename({flag!r}) + ".scoring") for p in os.listdir({folder!r})):
            open(mine, "w").close()
            time.sleep({seconds})
    return digit_share(completions)
"""


@pytest.mark.slow  # make test-slow (CI runs it)
def test_slurms_signal_to_every_process_while_the_reward_workers_score_saves(
    base_config: dict, tmp_path: Path
) -> None:
    import psutil

    flag = tmp_path / "slow"
    (tmp_path / "digits.py").write_text(
        DIGITS + SLOW.format(flag=str(flag), folder=str(tmp_path), seconds=SLOW_SCORE_S)
    )
    prompts = write_prompts(tmp_path / "prompts.jsonl", 64)
    config = grpo_config(base_config, {"train": prompts, "reward": tmp_path / "digits.py"})
    out = tmp_path / "run"
    config = merge(
        config,
        rewards=[f"{tmp_path / 'digits.py'}:slow_digits"],
        reward_num_workers=1,
        micro_batch_size=8,
        gradient_accumulation_steps=1,
        train_iters=400,
        logger={"output_dir": str(out)},
        checkpoint=[{"type": "deepspeed", "output_dir": str(tmp_path / "ckpt")}],
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", "2"]
    env = child_env()
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)  # torchrun's own default unless posttrain raises it
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    metrics = out / "train-log-metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    flag.touch()
    while time.time() < deadline and not any(p.name.startswith("slow.scoring") for p in tmp_path.iterdir()):
        time.sleep(0.1)
    assert time.time() < deadline, "no reward call started scoring slowly"
    family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    assert len(family) >= 6, [p.name() for p in family]  # command, torchrun, 2 ranks, reward processes
    for member in family:  # SLURM: every process of the job step
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signal.SIGTERM)
    signalled = time.time()
    said, _ = process.communicate(timeout=240)
    assert process.returncode == 0, said[-4000:]
    assert time.time() - signalled > SLOW_SCORE_S - 5  # the step was slower than torchrun's grace
    assert "Traceback" not in said and "RewardError" not in said, said[-4000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["iter"]
    assert f"stopped early at step {last}" in said, said[-4000:]
    assert (tmp_path / "ckpt" / f"global_step_{last}" / "posttrain_state.json").is_file()
    assert not (out / "kill-switch").exists()
