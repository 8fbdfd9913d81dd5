"""Online RL on a GPU: a GRPO run with the transformers backend in bf16, and the vLLM backend (skipped without
vLLM): its sampling log-probabilities equal the trainer's at step 0 (bf16 tolerance), and the weights it
generates with change after a sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.grpo_helpers import DIGITS, grpo_config, write_prompts
from tests.integration.helpers import metrics, train

pytestmark = pytest.mark.gpu


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "digits.py").write_text(DIGITS)
    return {"train": write_prompts(tmp_path / "prompts.jsonl", 64), "reward": tmp_path / "digits.py"}


def test_grpo_trains_in_bf16_on_a_gpu(base_config: dict, files: dict[str, Path]) -> None:
    config = grpo_config(base_config, files, train_iters=12, beta=0.02, model={"dtype": "bfloat16"})
    result = train(config)
    assert next(result.model.parameters()).device.type == "cuda"
    steps = [r for r in metrics(config) if "reward" in r]
    assert len(steps) == 12 and steps[-1]["reward"] > steps[0]["reward"]
    assert all(0 < r["generation_share"] < 1 for r in steps)


def test_vllm_engine_on_the_gpu_takes_pushed_weights(tmp_path: Path) -> None:
    """The colocated engine on the GPU (``external_launcher``, pushed weights through ``reload_weights``, the
    prefix cache emptied): its greedy completions of long prompts equal transformers' before and after the
    weights change (the CPU build runs the same script in tests/integration/test_vllm_engine.py)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("vllm")
    from posttrain.testing.env import child_env

    script = Path(__file__).parents[1] / "resources" / "vllm_push.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--cuda"],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == result["expected_before"] and result["after"] == result["expected_after"]
    assert result["after"] != result["before"]
