"""Generation ahead of training on vLLM's CPU build (``make test-vllm``): a ``posttrain vllm-serve`` server
generates the next batches while the trainer trains (``max_staleness``), and the run stays exact: the same
records on every run, after a SIGKILL and ``auto_resume``, and on two trainer processes; ``max_staleness: 0``
is the synchronous run; each batch comes from the weights the rule names (``policy_version``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.dist import free_port
from posttrain.testing.served import vllm_server
from tests.agent_endpoint_helpers import write_agent
from tests.grpo_helpers import DIGITS, engine_grpo_config
from tests.resume_helpers import assert_same_continuation, cli, kill_and_resume, last_metrics

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

STEPS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server for every run of the module (each run pushes its own weights before it generates)."""
    from posttrain.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("async")
    (root / "digits.py").write_text(DIGITS)
    model = write_tiny_model(root / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    config = engine_grpo_config(
        root,
        model,
        [f"{root / 'digits.py'}:digit_share"],
        completions_log_interval=1,
        train_iters=STEPS,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=free_port(),
        max_staleness=1,
        top_k=10,
        top_p=0.9,
        repetition_penalty=1.1,
    )
    path = root / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    with vllm_server(path, root / "server.log", config["vllm_server_port"]):
        yield {"root": root, "config": config}


def _run(served: dict[str, Any], out: Path, nproc: int = 1, **changes: Any) -> dict[int, dict[str, Any]]:
    config = copy.deepcopy(served["config"])
    config.update(logger={"output_dir": str(out)}, **changes)
    done = cli(config, out.with_suffix(".yaml"), nproc)
    assert done.returncode == 0, done.stderr[-4000:]
    return last_metrics(out)


def _versions(out: Path) -> dict[int, set[int]]:
    lines = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    found: dict[int, set[int]] = {}
    for line in lines:
        found.setdefault(line["generation"], set()).add(line["policy_version"])
    return found


def test_a_lag_is_exact_and_visible(served: dict[str, Any], tmp_path: Path) -> None:
    """Two runs with max_staleness 1 give the same records; batch k comes from the weights after k - 1
    batches; the staleness and both waits are in every step's record; at max_staleness 0 (the default) the
    engine's log-probabilities are the trainer's, and the lag changes the numbers from the second batch on."""
    one = _run(served, tmp_path / "one")
    again = _run(served, tmp_path / "again")
    for step in range(1, STEPS + 1):
        assert one[step]["reward"] == again[step]["reward"], step
        assert one[step]["loss"] == again[step]["loss"], step
        assert one[step]["sample/staleness_max"] == min(step - 1, 1), step
        assert one[step]["time_waiting_generation"] >= 0 and one[step]["time_waiting_weights"] >= 0
    assert _versions(tmp_path / "one") == {k: {max(0, k - 1)} for k in range(STEPS)}
    synchronous = _run(served, tmp_path / "sync", max_staleness=0)  # the default: the run without the key
    for step in range(1, STEPS + 1):
        assert "sample/staleness_max" not in synchronous[step]
        # truncated, penalised sampling on the server: the trainer's log-probabilities are the engine's
        assert abs(synchronous[step]["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4, step
        assert synchronous[step]["sampling/sampling_logp_difference/max"] < 1e-3, step
    # generated ahead, the first batch comes from the weights it trains: ratio 1 there too
    assert abs(one[1]["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4, one[1]
    assert one[1]["sampling/sampling_logp_difference/max"] < 1e-3, one[1]
    assert one[1]["reward"] == synchronous[1]["reward"] and one[2]["reward"] != synchronous[2]["reward"]


def test_resumed_and_two_processes_give_the_same_records(served: dict[str, Any], tmp_path: Path) -> None:
    """SIGKILLed after a checkpoint (the batch generated ahead saved in it) and resumed: the uninterrupted
    records; two trainer processes (each generating its own slots ahead): the one-process records."""
    results = kill_and_resume(served["config"], tmp_path, nproc=1, kill_at=3, total=STEPS)
    assert_same_continuation(results, 3, STEPS)
    for step in range(4, STEPS + 1):
        assert results["resumed_metrics"][step]["reward"] == results["reference_metrics"][step]["reward"], (
            step
        )
    two = _run(served, tmp_path / "two", nproc=2, micro_batch_size=8)
    one = results["reference_metrics"]
    for step in range(1, STEPS + 1):
        assert two[step]["reward"] == one[step]["reward"], step
        # the same completions (rewards equal); the loss to float32's noise: the first step's exactly, the
        # later ones after updates whose gradients two processes sum in another order (seen: 7e-6 at step 6)
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-6 if step == 1 else 3e-5), step


def test_a_longer_lag_and_weights_synced_every_other_batch(served: dict[str, Any], tmp_path: Path) -> None:
    """max_staleness 2 with weight_sync_steps 2: batch k from the weights after (max(0, k - 2) // 2) * 2
    batches, as the pre-flight report says. max_staleness 0 with weight_sync_steps 2, killed after the
    checkpoint of step 2 (nothing in flight there) and resumed: the uninterrupted run's records."""
    _run(served, tmp_path / "lag2", max_staleness=2, weight_sync_steps=2)
    assert _versions(tmp_path / "lag2") == {k: {max(0, k - 2) // 2 * 2} for k in range(STEPS)}
    config = copy.deepcopy(served["config"])
    config.update(max_staleness=0, weight_sync_steps=2)
    (tmp_path / "sync2").mkdir()
    results = kill_and_resume(config, tmp_path / "sync2", nproc=1, kill_at=2, total=STEPS)
    assert_same_continuation(results, 2, STEPS)
    for step in range(3, STEPS + 1):
        assert results["resumed_metrics"][step]["reward"] == results["reference_metrics"][step]["reward"], (
            step
        )


def test_servers_signalled_with_the_trainer_still_save(served: dict[str, Any], tmp_path: Path) -> None:
    """One allocation ends: SIGTERM to the trainer and to its server at once, a batch generated ahead in
    flight there (the server, shutting down, holds it unanswered). The trainer waits neither for that answer
    nor for the server to come back: it saves after its last whole step, without the batches whose server is
    gone (the checkpoint says which it left out), and exits 0; resumed against another server, it goes on,
    generating what was left out again and saying why."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from posttrain.testing.env import child_env

    port = free_port()
    config = copy.deepcopy(served["config"])
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    config.update(
        vllm_server_port=port,
        train_iters=200,
        logger={"output_dir": str(out)},
        checkpoint=[{"type": "deepspeed", "output_dir": str(ckpt)}],
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    lines: list[str] = []
    with vllm_server(path, tmp_path / "server.log", port) as server:
        command = [sys.executable, "-m", "posttrain", "train", str(path)]
        trainer = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(),
            start_new_session=True,
        )
        assert trainer.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(trainer.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        metrics = out / "train-log-metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            time.sleep(0.1)
        for process in (trainer, server):  # the allocation's end reaches both
            os.killpg(process.pid, signal.SIGTERM)
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        reader.join(timeout=10)
        said = "".join(lines)
    assert trainer.returncode == 0, said[-4000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["iter"]
    assert f"stopped early at step {last}" in said and "Traceback" not in said, said[-4000:]
    assert (ckpt / f"global_step_{last}" / "posttrain_state.json").is_file()
    left_out = "could not be generated before the stop" in said
    resumed = copy.deepcopy(config)
    resumed.update(
        vllm_server_port=served["config"]["vllm_server_port"],
        train_iters=last + 2,
        checkpoint=[{"type": "deepspeed", "output_dir": str(ckpt), "auto_resume": True}],
    )
    done = cli(resumed, tmp_path / "resumed.yaml")
    assert done.returncode == 0, done.stderr[-4000:]
    assert last_metrics(out)[last + 2]["iter"] == last + 2
    again = done.stdout + done.stderr
    assert ("in flight when the run that wrote the checkpoint stopped" in again) == left_out, again[-3000:]


def test_an_agent_that_owns_its_loop_generates_ahead_exactly(served: dict[str, Any], tmp_path: Path) -> None:
    """agent_function's episodes on the generation thread, their calls served by the vLLM server from the
    weights the rule names: two runs with max_staleness 1 log the same records; the engine's log-probabilities
    of the episodes' sampled tokens are the trainer's (the ratio 1 on the first batch, from the same weights)."""
    files = write_agent(tmp_path)
    agent = {"agent_function": files["agent_function"], "rewards": [files["reward"]], "train_iters": 2}
    # one prompt's 8 episodes a step; room for both calls and the observation between them
    agent.update(micro_batch_size=4, gradient_accumulation_steps=2, max_completion_length=48)
    one = _run(served, tmp_path / "agent-one", **agent)
    again = _run(served, tmp_path / "agent-again", **agent)
    for step in range(1, 3):
        assert one[step]["reward"] == again[step]["reward"] and one[step]["loss"] == again[step]["loss"], step
        assert one[step]["agent/calls"] == 2 and one[step]["sample/staleness_max"] == min(step - 1, 1), step
    assert abs(one[1]["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4, one[1]
