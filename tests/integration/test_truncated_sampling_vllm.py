"""The policy under truncation on vLLM's CPU build (``make test-vllm``): with ``top_k``, ``top_p``, ``min_p``, a
repetition penalty and all of them, the engine's log-probabilities of its samples are the trainer's (ratio 1,
gap under 1e-3 in float32) and the hand computation's, before and after a real update; over the whole vocabulary
they would not be (the kept mass: the defect this replaces). The runs' records (colocated, server, generation
ahead) are checked in test_vllm_engine.py and test_async_rl.py, whose configs truncate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.testing.env import child_env

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

SCRIPT = Path(__file__).parents[1] / "resources" / "truncated_ratio.py"


def test_engine_and_trainer_agree_under_every_truncating_setting(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 10, found
    for name, numbers in found.items():
        assert numbers["tokens"] >= 80, (name, numbers)
        assert numbers["gap"] < 1e-3 and numbers["hand_gap"] < 1e-4, (name, numbers)
        assert abs(numbers["ratio_mean"] - 1) < 1e-4, (name, numbers)
    for name in ("top_k", "top_p", "min_p"):  # the full vocabulary's ratio is the kept mass
        assert found[name]["full_vocabulary_ratio_mean"] < 0.9, (name, found[name])
