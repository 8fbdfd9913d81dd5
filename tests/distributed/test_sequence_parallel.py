"""Ulysses sequence parallelism with two CPU processes: SP=2 gives SP=1's loss, eval loss and gradients
(LM head included) under ZeRO 0, 2 and 3, for sft and causal, padded and packed, with gradient
accumulation, a slice without labels, and the tiled MLP, tiled loss and checkpoint offload switched on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from posttrain.dist import free_port
from posttrain.testing.data import text_rows, write_jsonl
from posttrain.testing.env import child_env
from tests.integration.helpers import merge
from tests.resume_helpers import assert_same_continuation, kill_and_resume

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parents[1] / "resources" / "first_step_grads.py"
STAGES = (0, 2, 3)


def long_prompt_rows(n: int) -> list[dict[str, Any]]:
    """Chats whose answer sits in the second half of the sequence: the first slice has no labels."""
    rows = []
    for i in range(n):
        words = " ".join(str((i * 7 + k) % 50) for k in range(12 + i % 9))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"repeat the last number of {words}"},
                    {"role": "assistant", "content": words.split()[-1]},
                ]
            }
        )
    return rows


def cases(base: dict[str, Any], tmp: Path) -> dict[str, dict[str, Any]]:
    chats = write_jsonl(tmp / "chats.jsonl", long_prompt_rows(40))
    text = write_jsonl(tmp / "text.jsonl", text_rows(60))
    common = merge(
        base,
        train_iters=2,
        eval_at_end=True,
        optimizer={"lr": 0.0},  # the eval loss then compares the forward pass at the same weights
        data={"sources": [str(chats)], "train_eval_split": [0.8, 0.2], "max_length": 96},
    )
    causal = {"sources": [str(text)], "train_eval_split": [0.8, 0.2], "max_length": 48}
    return {
        "sft": merge(common, micro_batch_size=2, gradient_accumulation_steps=2),
        "sft-packed-tiled": merge(
            common,
            micro_batch_size=1,
            gradient_accumulation_steps=2,
            data={"pack_samples": True, "max_length": 160},
            tiled_mlp_compute=True,
            tiled_loss_compute=True,
            activation_checkpoint_cpu_offload=True,
            model={"disable_activation_checkpoint": False},
        ),
        "causal": merge(common, type="causal", micro_batch_size=2, data=causal),
        "causal-packed": merge(
            common, type="causal", micro_batch_size=1, data={**causal, "pack_samples": True, "max_length": 96}
        ),
    }


def run_cases(configs: dict[str, dict[str, Any]], tmp: Path, nproc: int) -> dict[str, Any]:
    specs = []
    for name, config in configs.items():
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        specs.append(f"{name}={path}")
    out = tmp / f"results-{nproc}.pt"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    command += [f"--master_port={free_port()}", str(WORKER), str(out), *specs]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out)


def test_sp2_matches_sp1_under_every_zero_stage(base_config: dict, tmp_path: Path) -> None:
    base = cases(base_config, tmp_path)
    reference = run_cases(
        {name: merge(c, logger={"output_dir": str(tmp_path / f"ref-{name}")}) for name, c in base.items()},
        tmp_path,
        nproc=1,
    )
    parallel = {
        f"{name}-zero{stage}": merge(
            config,
            sequence_parallel_size=2,
            deepspeed={"zero_optimization": {"stage": stage}},
            logger={"output_dir": str(tmp_path / f"sp-{name}-{stage}")},
        )
        for stage in STAGES
        for name, config in base.items()
    }
    results = run_cases(parallel, tmp_path, nproc=2)
    assert not any(r["sp_attention_calls"] for r in reference.values())
    assert results["sft-zero0"]["slices_without_labels"] > 0  # rank 0's half of a long prompt
    for key, got in results.items():
        assert got["sp_attention_calls"] > 0, key
        want = reference[key.rsplit("-zero", 1)[0]]
        assert abs(got["loss"] - want["loss"]) <= 1e-5, (key, got["loss"], want["loss"])
        assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-5, (key, got["eval_loss"], want["eval_loss"])
        assert got["grads"].keys() == want["grads"].keys()
        assert "lm_head.weight" in got["grads"]
        worst = max(float((got["grads"][k] - want["grads"][k]).abs().max()) for k in want["grads"])
        assert worst <= 1e-6, (key, worst)


@pytest.mark.slow  # make test-slow (CI runs it)
def test_sp2_killed_and_resumed_continues_exactly(base_config: dict, tmp_path: Path) -> None:
    base = merge(
        base_config,
        epochs=2,
        micro_batch_size=1,
        sequence_parallel_size=2,
        data={"pack_samples": True, "max_length": 128},
        deepspeed={"zero_optimization": {"stage": 2}},
    )
    results = kill_and_resume(base, tmp_path, nproc=2, kill_at=4, total=9)
    assert_same_continuation(results, kill_at=4, total=9)
