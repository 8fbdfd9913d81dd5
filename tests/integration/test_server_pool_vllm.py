"""A pool of ``posttrain vllm-serve`` servers on vLLM's CPU build (``make test-vllm``), on 127.0.0.1: two
servers give the numbers of one, on one trainer process and on two trainer "nodes" (two ``posttrain train``
commands joined by ``--launcher-args``, generating ahead with ``max_staleness``; two processes splitting each
row, ``sequence_parallel_size: 2``); a server SIGKILLed mid-run
changes no number, and started again at its address it is given the current weights and serves again."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.dist import free_port
from posttrain.testing.env import child_env
from posttrain.testing.served import vllm_server
from tests.agent_helpers import agent_config, teach_tool_calls, tool_prompts
from tests.grpo_helpers import DIGITS, engine_grpo_config
from tests.resume_helpers import cli, last_metrics, two_nodes

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

STEPS = 6
CONTEXT = 352  # the agents' prompts and completions (tests/agent_helpers.py)
#: the two servers' cores: this worker's first and last (make test-vllm gives each worker cores of its own)
CORES = sorted(os.sched_getaffinity(0))
#: a reward that holds the run after 3 steps while the file `hold` exists, until the file `go` does
HOLDING = """
import os, time

def held_digit_share(completions, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step == 3 and os.path.exists(HOLD):
        while not os.path.exists(GO):
            time.sleep(0.2)
    return digit_share(completions)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two servers, one core each; every run pushes its own weights before it generates."""
    from posttrain.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("pool")
    (root / "digits.py").write_text(
        f"HOLD = {str(root / 'hold')!r}\nGO = {str(root / 'go')!r}\n" + DIGITS + HOLDING
    )
    base = write_tiny_model(root / "base", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    model = teach_tool_calls(base, root)  # calls the agents' tool: the pool serves their rollouts too
    ports = [free_port(), free_port()]
    config = engine_grpo_config(
        root,
        model,
        [f"{root / 'digits.py'}:held_digit_share"],
        log_completions=False,
        train_iters=STEPS,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=[f"http://127.0.0.1:{port}" for port in ports],
        vllm_server_timeout=60,
        vllm_max_model_length=CONTEXT,
    )
    path = root / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    with (
        vllm_server(path, root / "a.log", ports[0], cores=CORES[:1]),
        vllm_server(path, root / "b.log", ports[1], cores=CORES[-1:]) as second,
    ):
        yield {"root": root, "config": config, "path": path, "ports": ports, "second": second}


def _config(pool: dict[str, Any], out: Path, servers: int = 2, **changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(pool["config"])
    config["vllm_server_base_url"] = config["vllm_server_base_url"][:servers]
    config.update(logger={"output_dir": str(out)}, **changes)
    return config


def _run(pool: dict[str, Any], out: Path, servers: int = 2, **changes: Any) -> dict[int, dict[str, Any]]:
    done = cli(_config(pool, out, servers, **changes), out.with_suffix(".yaml"))
    assert done.returncode == 0, done.stderr[-4000:]
    return last_metrics(out)


def _completions_served(log: Path) -> int:
    return log.read_text().count("POST /v1/completions")


def _same(
    one: dict[int, dict[str, Any]],
    other: dict[int, dict[str, Any]],
    exact_loss: bool = True,
    rel: float = 0.0,
) -> None:
    """The same rewards and generation rounds every step (the same completions), and the same loss: exactly,
    or within 1e-5 where the sums are split apart, or ``rel`` where each row is too (float32 updates after
    differently ordered sums drift apart a little each step)."""
    for step in range(1, STEPS + 1):
        assert one[step]["reward"] == other[step]["reward"], step
        rounds = "dynamic_sampling/generation_rounds"
        assert one[step].get(rounds) == other[step].get(rounds), step
        if exact_loss:
            assert one[step]["loss"] == other[step]["loss"], step
        else:
            assert one[step]["loss"] == pytest.approx(other[step]["loss"], abs=1e-5, rel=rel), step


def test_two_servers_give_one_servers_numbers_on_one_and_on_two_trainer_nodes(
    pool: dict[str, Any], tmp_path: Path
) -> None:
    """With grpo's dynamic sampling on (its refill rounds go through the pool too, generated from the
    current weights after the batches ahead), at max_staleness 0 and 1."""
    root, dynamic = pool["root"], {"dynamic_sampling": True, "dynamic_filtering_range": [0.1, 1.0]}
    one = _run(pool, tmp_path / "one", servers=1, **dynamic)
    before = _completions_served(root / "b.log")
    two = _run(pool, tmp_path / "two", **dynamic)
    _same(one, two)
    extra = sum(two[step]["dynamic_sampling/extra_completions"] for step in range(1, STEPS + 1))
    assert extra > 0, two  # some batches were refilled
    # half of every batch and of every refill round
    assert _completions_served(root / "b.log") - before == (STEPS * 32 + extra) // 2
    lagged = _run(pool, tmp_path / "lag-one", servers=1, max_staleness=1, **dynamic)
    config = _config(pool, tmp_path / "nodes", max_staleness=1, micro_batch_size=8, **dynamic)
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(config))
    outputs = two_nodes(path, timeout=600)
    assert "world size 2" in outputs[0] and "2 servers (" in outputs[0]
    _same(lagged, last_metrics(tmp_path / "nodes"), exact_loss=False)
    # two processes splitting every row (sequence parallelism), each generating its share ahead on the pool
    split = _config(pool, tmp_path / "split", max_staleness=1, sequence_parallel_size=2, **dynamic)
    done = cli(split, tmp_path / "split.yaml", nproc=2, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "each sample split over 2 processes" in done.stdout
    _same(lagged, last_metrics(tmp_path / "split"), exact_loss=False, rel=1e-4)


def test_multi_turn_tool_rollouts_through_a_pool_give_one_servers_numbers(
    pool: dict[str, Any], tmp_path: Path
) -> None:
    """Every turn of an agent's rollout (the tool's result fed back, the next turn generated) goes through the
    pool, and the records are one server's."""
    records = []
    for servers in (1, 2):
        urls = pool["config"]["vllm_server_base_url"][:servers]
        config = agent_config(
            Path(pool["config"]["model"]["name_or_path"]),
            tool_prompts(tmp_path, count=32),
            tmp_path / f"agents-{servers}",
            train_iters=3,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=urls,
            vllm_max_model_length=CONTEXT,
        )
        done = cli(config, tmp_path / f"agents-{servers}.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
        records.append(last_metrics(tmp_path / f"agents-{servers}"))
    one, two = records
    assert any(one[step]["tools/call_frequency"] > 0 for step in (1, 2, 3)), one
    for step in (1, 2, 3):
        assert one[step]["reward"] == two[step]["reward"] and one[step]["loss"] == two[step]["loss"], step
        assert one[step]["tools/call_frequency"] == two[step]["tools/call_frequency"], step


def test_a_server_killed_mid_run_changes_no_number_and_rejoins_when_started_again(
    pool: dict[str, Any], tmp_path: Path
) -> None:
    root, second = pool["root"], pool["second"]
    reference = _run(pool, tmp_path / "reference", servers=1)
    (root / "hold").touch()
    out = tmp_path / "killed"
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(_config(pool, out)))
    run = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "train", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
    )
    metrics = out / "train-log-metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 1):
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before its first step"
        time.sleep(0.2)
    os.killpg(second.pid, signal.SIGKILL)  # the second server and its engine, mid-run
    second.wait()
    with vllm_server(pool["path"], root / "b-again.log", pool["ports"][1], cores=CORES[-1:]):
        (root / "go").touch()  # the run goes on past step 3 once the server is back
        output = run.communicate(timeout=600)[0]
        served_again = _completions_served(root / "b-again.log")
    assert run.returncode == 0, output[-4000:]
    _same(reference, last_metrics(out))
    assert f"vLLM server at http://127.0.0.1:{pool['ports'][1]}" in output and "out of the pool" in output
    assert "is back with the current weights: it serves again" in output, output[-3000:]
    assert served_again > 0
