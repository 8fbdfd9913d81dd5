"""Online RL on a GPU: a GRPO run with the transformers backend in bf16, and with vLLM (skipped without it):
the colocated engine takes pushed weights (greedy completions equal transformers' before and after), and
server mode sends them over NCCL (the engine's and the trainer's log-probabilities stay close while the weights
move: the server generates with the trained weights)."""

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


def test_server_mode_on_the_gpu_takes_the_weights_over_nccl(tmp_path: Path, files: dict[str, Path]) -> None:
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    import yaml

    pytest.importorskip("vllm")
    from posttrain.testing.env import child_env
    from posttrain.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = {
        "type": "grpo",
        "model": {"name_or_path": str(model), "dtype": "bfloat16"},
        "data": {"sources": [str(files["train"])], "max_length": 64, "dl_num_workers": 0},
        "rewards": [f"{files['reward']}:digit_share"],
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "max_completion_length": 16,
        "train_iters": 4,
        "optimizer": {"lr": 3e-3},  # the weights move: a server that kept the old ones would disagree
        "loss_log_interval": 1,
        "logger": {"output_dir": str(tmp_path / "run")},
        "use_vllm": True,
        "vllm_mode": "server",
        "vllm_server_host": "127.0.0.1",
        "vllm_server_port": port,
        "vllm_gpu_memory_utilization": 0.25,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    server = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "vllm-serve", str(path)], env=child_env(), start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(2)
        done = subprocess.run(
            [sys.executable, "-m", "posttrain", "train", str(path)],
            capture_output=True,
            text=True,
            timeout=600,
            env=child_env(),
        )
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    records = [
        json.loads(line) for line in (tmp_path / "run" / "train-log-metrics.jsonl").read_text().splitlines()
    ]
    differences = [r["sampling/sampling_logp_difference/mean"] for r in records if "reward" in r]
    assert len(differences) == 4 and all(d < 0.05 for d in differences), (
        differences
    )  # bf16 kernels differ a little
