"""Prompts of mixed difficulty and a reward for the dynamic-sampling tests (integration and two-process)."""

from __future__ import annotations

import json
import random
from pathlib import Path

#: every "easy" prompt scores 1 on each completion (a group without spread: filtered); the others score
#: each completion by its length's parity (a spread, most of the time). With DIE_AT set (a file holding a
#: step), the process kills itself when a refill round of that step is scored (its second scoring call).
MIXED = """
import os, signal
from pathlib import Path

CALLS = {}


def mixed(completions, easy, trainer_state, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    step = trainer_state.global_step
    CALLS[step] = CALLS.get(step, 0) + 1
    flag = Path(__file__).with_name("die_at")
    if flag.exists() and int(flag.read_text()) == step and CALLS[step] == 2:
        flag.unlink(missing_ok=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0 if e else float(len(t) % 2) for e, t in zip(easy, texts)]
"""


def write_mixed(root: Path, count: int = 48, seed: int = 0) -> dict[str, Path]:
    """``count`` prompts, every third one easy, and the reward beside them."""
    rng = random.Random(seed)
    train = root / "mixed.jsonl"
    with train.open("w") as out:
        for index in range(count):
            number = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            row = {"prompt": [{"role": "user", "content": f"reverse {number}"}], "easy": index % 3 == 0}
            out.write(json.dumps(row) + "\n")
    reward = root / "mixed.py"
    reward.write_text(MIXED)
    return {"train": train, "reward": reward}


def dynamic_config(base_config: dict, files: dict[str, Path], **changes: object) -> dict:
    """grpo on the mixed prompts: groups of 4, 8 prompts a step, dynamic sampling on."""
    config = {
        **{k: v for k, v in base_config.items() if k not in ("data", "micro_batch_size")},
        "type": "grpo",
        "data": {"sources": [str(files["train"])], "max_length": 64, "dl_num_workers": 0},
        "rewards": [f"{files['reward']}:mixed"],
        "num_generations": 4,
        "max_completion_length": 12,
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 3e-3},
        "loss_log_interval": 1,
        "dynamic_sampling": True,
        "completions_log_interval": 1,
        "train_iters": 3,
    }
    config.update(changes)
    return config
