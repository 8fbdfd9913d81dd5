"""Prompt data, a reward and a config for grpo tests (integration and two-process)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tests.integration.helpers import merge

DIGITS = '''
def digit_share(completions, **kwargs):
    """The share of digit characters in each completion (TRL's reward-function arguments)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]
'''


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            number = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            row = {"prompt": [{"role": "user", "content": f"reverse {number}"}], "answer": number[::-1]}
            out.write(json.dumps(row) + "\n")
    return path


def grpo_config(base_config: dict, files: dict[str, Path], **changes: Any) -> dict:
    config = {
        **{k: v for k, v in base_config.items() if k not in ("data", "micro_batch_size")},
        "type": "grpo",
        "data": {"sources": [str(files["train"])], "max_length": 64, "dl_num_workers": 0},
        "rewards": [
            f"{files['reward']}:digit_share",
            {"type": "exact_match", "extract": "none", "weight": 0.0},
        ],
        "num_generations": 8,
        "max_completion_length": 16,
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 3e-3},
        "loss_log_interval": 1,
    }
    return merge(config, **changes)


def engine_grpo_config(root: Path, model: Path, rewards: list[Any], **changes: Any) -> dict[str, Any]:
    """The vLLM tests' grpo run: 64 digit prompts, groups of 8 completions of up to 16 tokens, 32 completions a
    step, float32 (``changes`` deep-merged in)."""
    config = {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "float32", "disable_activation_checkpoint": True},
        "data": {
            "sources": [str(write_prompts(root / "train.jsonl", 64))],
            "max_length": 96,
            "dl_num_workers": 0,
        },
        "rewards": rewards,
        "num_generations": 8,
        "max_completion_length": 16,
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 3e-3},
        "scheduler": {"name": "constant", "warmup_ratio": 0},
        "loss_log_interval": 1,
    }
    return merge(config, **changes)


def distill_config(root: Path, prompts: Path, **changes: Any) -> dict[str, Any]:
    """A distill run on tiny models written under ``root``: a 2-layer student of width 64 (2 heads) and a
    3-layer teacher of width 128 (4 heads) with the same tokenizer, on ``prompts``, completions of up to 16
    tokens, 16 a step, float32 (``changes`` deep-merged in)."""
    from posttrain.tiny_model import write_tiny_model

    student = write_tiny_model(root / "student", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    teacher = write_tiny_model(root / "teacher", seed=0, hidden_size=128, layers=3, vocab_size=1024, heads=4)
    config = {
        "type": "distill",
        "model": {"name_or_path": str(student), "dtype": "float32", "disable_activation_checkpoint": True},
        "teacher_model_name_or_path": str(teacher),
        "beta": 0.5,
        "data": {"sources": [str(prompts)], "max_length": 64, "dl_num_workers": 0},
        "max_completion_length": 16,
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-2},
        "loss_log_interval": 1,
    }
    return merge(config, **changes)
