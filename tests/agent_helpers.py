"""A tiny model that calls a tool: the session's tiny model taught the call format (``testing.tool_task``)
by a short SFT with the ``hermes`` template; prompts and a grpo config with the tool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.testing import tool_task
from tests.integration.helpers import merge, train


def teach_tool_calls(tiny_model_dir: Path, root: Path, steps: int = 80) -> Path:
    """SFT on tool-call conversations; returns the exported model."""
    rows = [tool_task.tool_call_row(a, b) for a, b in tool_task.pairs(1000, 0)]
    data = tool_task.write_rows(root / "tool-sft.jsonl", rows)
    out = root / "tool-sft"
    train(
        {
            "type": "sft",
            "model": {
                "name_or_path": str(tiny_model_dir),
                "dtype": "float32",
                "disable_activation_checkpoint": True,
            },
            "tokenizer": {"chat_template": "hermes"},
            "data": {"sources": [str(data)], "max_length": 256, "dl_num_workers": 0},
            "micro_batch_size": 16,
            "train_iters": steps,
            "optimizer": {"lr": 5e-3},
            "scheduler": {"name": "constant", "warmup_ratio": 0},
            "logger": {"output_dir": str(out)},
            "loss_log_interval": 0,
            "checkpoint": [
                {"type": "huggingface", "output_dir": str(out / "export"), "save_end_of_training": True}
            ],
        }
    )
    return out / "export" / "final"


def tool_prompts(root: Path, count: int = 64, seed: int = 1) -> Path:
    rows = [tool_task.prompt_row(a, b) for a, b in tool_task.pairs(count, seed)]
    return tool_task.write_rows(root / f"tool-prompts-{seed}.jsonl", rows)


def agent_config(model: Path, prompts: Path, out: Path, **changes: Any) -> dict[str, Any]:
    config = {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "float32", "disable_activation_checkpoint": True},
        "data": {"sources": [str(prompts)], "max_length": 256, "dl_num_workers": 0},
        "rewards": [{"type": "exact_match", "column": "answer", "extract": "none"}],
        "tools": [tool_task.tool_entry()],
        "num_generations": 4,
        "max_completion_length": 96,
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"lr": 1e-4},
        "scheduler": {"name": "constant", "warmup_ratio": 0},
        "loss_log_interval": 1,
        "completions_log_interval": 1,
        "logger": {"output_dir": str(out)},
    }
    return merge(config, **changes)
