"""Agents that own their loop (``agent_function``): a ReAct agent written with the OpenAI client and
posttrain's sandbox runs against the endpoint posttrain serves on 127.0.0.1; its trajectories are the engine's
token ids (what it added between calls out of the loss), a fresh conversation is a new branch, a crash is
unscored, budgets end a runaway, and GRPO trains on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.generation.keyed import completion_key
from posttrain.generation.transformers_engine import TransformersEngine
from posttrain.generation.types import Sampling
from posttrain.rollout.agent_endpoint import AgentLoop
from posttrain.rollout.sampler import stop_ids
from tests.agent_endpoint_helpers import write_agent
from tests.grpo_helpers import write_prompts
from tests.integration.helpers import metrics, train
from tests.resume_helpers import cli, last_metrics

pytestmark = pytest.mark.integration


class Limits:
    """The config keys the agent loop reads."""

    def __init__(self, agent: str, **changes: object) -> None:
        self.agent_function, self.agent_max_calls, self.agent_timeout = agent, 32, 60.0
        self.max_completion_length = 48
        self.data = type("Data", (), {"max_prompt_length": None, "max_length": 128})()
        self.__dict__.update(changes)


def _rows(contents: list[str]) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": c}], "__origin__": f"test row {i}"}
        for i, c in enumerate(contents)
    ]


def test_trajectories_are_the_engines_tokens_with_what_the_agent_added_out_of_the_loss(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    lines: list[str] = []
    monkeypatch.setattr("posttrain.rollout.agent_endpoint.say", lines.append)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    stops = stop_ids(tiny_tokenizer, model)
    backend = TransformersEngine(stops, tiny_tokenizer.pad_token_id or 0)
    files = write_agent(tmp_path)
    loop = AgentLoop(Limits(files["agent_function"]), tiny_tokenizer, stops)
    rows = _rows(["reverse 123", "reverse 4567", "wander 89", "crash 1"])
    keys = [completion_key(0, 0, 0, i, 0) for i in range(len(rows))]
    sampling = Sampling(16, 1.0)
    try:
        out = loop.generate(backend, model, rows, [[1]] * len(rows), sampling, keys)
        again = loop.generate(backend, model, rows, [[1]] * len(rows), sampling, keys)
    finally:
        loop.close()
    assert out.ids == again.ids and out.prompt_ids == again.prompt_ids  # keyed: the same episodes
    for index in (0, 1):  # think, act, observe, answer: one branch
        first, second = out.calls[index]
        assert not second["new_branch"] and second["branch"] == 0
        seen = first["prompt_ids"] + first["completion_ids"]
        assert second["prompt_ids"][: len(seen)] == seen  # the engine's tokens, not re-tokenized text
        added = second["prompt_ids"][len(seen) :]
        trajectory = out.prompt_ids[index] + out.ids[index]
        assert trajectory == second["prompt_ids"] + second["completion_ids"]
        mask = out.tool_mask[index]
        expected = [1] * len(first["completion_ids"]) + [0] * len(added) + [1] * len(second["completion_ids"])
        assert mask == expected
        # the sandbox's output, as the template renders the agent's new message
        assert f"Observation: {out.columns['observation'][index]}" in tiny_tokenizer.decode(added)
        # each call is what the engine samples from that prompt with the call's key
        again_sampled = backend.generate(
            model, [second["prompt_ids"]], Sampling(6, 1.0), [completion_key(keys[index], 1)]
        )
        assert again_sampled.ids[0] == second["completion_ids"]
        assert out.columns["agent_reward"][index] is not None and "observation" in out.columns
    wander = out.calls[2]
    assert [c["new_branch"] for c in wander] == [True, True]
    assert out.prompt_ids[2] == wander[1]["prompt_ids"]  # the last branch is trained
    assert out.columns["agent_reward"][3] is None  # crashed: unscored
    said = " ".join(lines)
    assert (
        len(lines) == 1
        and "raised in episode" in said
        and "RuntimeError: the agent's own bug" in said
        and "test row 3" in said
    )
    records = loop.records()
    assert records["agent/episodes"] == 8 and records["agent/branched"] == 2 and records["agent/crashed"] == 2


def test_budgets_end_a_runaway_episode(tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    stops = stop_ids(tiny_tokenizer, model)
    backend = TransformersEngine(stops, tiny_tokenizer.pad_token_id or 0)
    files = write_agent(tmp_path)
    loop = AgentLoop(Limits(files["agent_function"], agent_max_calls=1), tiny_tokenizer, stops)
    try:
        out = loop.generate(backend, model, _rows(["reverse 12"]), [[1]], Sampling(16, 1.0), [5])
    finally:
        loop.close()
    assert len(out.calls[0]) == 1 and out.truncated[0]  # the second call was refused: the agent raised
    assert out.columns["agent_reward"][0] is None
    assert loop.records()["agent/budget"] == 1


def _grpo(base_config: dict, tmp_path: Path) -> tuple[dict, dict[str, str]]:
    files = write_agent(tmp_path)
    config = {
        **{k: v for k, v in base_config.items() if k not in ("data", "micro_batch_size")},
        "type": "grpo",
        "data": {
            "sources": [str(write_prompts(tmp_path / "p.jsonl", 16))],
            "max_length": 96,
            "dl_num_workers": 0,
        },
        "rewards": [files["reward"]],
        "agent_function": files["agent_function"],
        "num_generations": 4,
        "max_completion_length": 48,
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "train_iters": 2,
        "loss_log_interval": 1,
        "completions_log_interval": 1,
    }
    return config, files


def test_grpo_trains_on_an_agents_episodes_and_records_them(base_config: dict, tmp_path: Path) -> None:
    config, _ = _grpo(base_config, tmp_path)
    train(config)
    steps = [r for r in metrics(config) if "reward" in r]
    assert len(steps) == 2 and all(r["loss"] == r["loss"] for r in steps)
    assert steps[0]["agent/calls"] == 2 and steps[0]["agent/branched"] == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 32 and all(len(line["calls"]) == 2 for line in lines)
    assert lines[0]["messages"][-1]["role"] == "assistant" and "Observation:" in json.dumps(
        lines[0]["messages"]
    )


@pytest.mark.distributed
def test_two_processes_splitting_each_row_give_one_processs_episodes(
    base_config: dict, tmp_path: Path
) -> None:
    """``sequence_parallel_size: 2``: each process plays half of the group's episodes against its own
    endpoint, the trajectories are exchanged and each training row split over the two; the records are one
    process's."""
    config, _ = _grpo(base_config, tmp_path)
    config.update(log_completions=False)
    runs = {}
    for name, nproc in (("one", 1), ("split", 2)):
        layout = {"sequence_parallel_size": nproc, "logger": {"output_dir": str(tmp_path / name)}}
        done = cli({**config, **layout}, tmp_path / f"{name}.yaml", nproc=nproc, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = last_metrics(tmp_path / name)
    assert "each sample split over 2 processes" in done.stdout
    for step in (1, 2):
        one, split = runs["one"][step], runs["split"][step]
        for key in ("reward", "agent/calls", "agent/branched", "num_tokens"):
            assert one[key] == split[key], (step, key)
        assert abs(one["loss"] - split["loss"]) <= 1e-6, (step, one["loss"], split["loss"])


@pytest.mark.slow  # make test-slow (CI runs it)
def test_a_run_killed_in_the_middle_of_an_episode_resumes_exactly(base_config: dict, tmp_path: Path) -> None:
    """SIGKILL after the first call of step 3's 5th episode (checkpoints every step, 8 episodes a step): the
    resumed run plays step 3's episodes again from their keys and logs the uninterrupted run's records."""
    config, files = _grpo(base_config, tmp_path)
    config.update(train_iters=4, log_completions=False, micro_batch_size=4)
    reference = {**config, "logger": {"output_dir": str(tmp_path / "reference")}}
    assert cli(reference, tmp_path / "reference.yaml").returncode == 0
    flag = Path(files["agent_function"].split(":")[0]).with_name("die_at_episode")
    flag.write_text(str(2 * 8 + 5))
    checkpoint = {
        "type": "deepspeed",
        "output_dir": str(tmp_path / "ckpt"),
        "auto_resume": True,
        "save_every_n_steps": 1,
    }
    interrupted = {**config, "logger": {"output_dir": str(tmp_path / "run")}, "checkpoint": [checkpoint]}
    assert cli(interrupted, tmp_path / "run.yaml").returncode != 0
    assert not flag.exists() and sorted(last_metrics(tmp_path / "run")) == [1, 2]
    done = cli(interrupted, tmp_path / "run.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    expected, resumed = last_metrics(tmp_path / "reference"), last_metrics(tmp_path / "run")
    for step in (3, 4):
        for key in ("reward", "loss", "agent/calls", "num_tokens"):
            assert resumed[step][key] == expected[step][key], (step, key)


def test_malformed_calls_are_answered_with_an_error_and_end_nothing(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path
) -> None:
    """What an agent (or anything on 127.0.0.1) may send: not JSON, wrong types, another episode's id, a
    stream; each is answered with an OpenAI error body, and the episode's next good call is served."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    stops = stop_ids(tiny_tokenizer, model)
    (tmp_path / "probe.py").write_text(PROBE)
    loop = AgentLoop(Limits(f"{tmp_path / 'probe.py'}:probe"), tiny_tokenizer, stops)
    try:
        out = loop.generate(
            TransformersEngine(stops, 0), model, _rows(["reverse 12"]), [[1]], Sampling(8, 1.0), [7]
        )
    finally:
        loop.close()
    statuses = out.columns["statuses"][0]
    assert statuses == [400, 400, 400, 400, 404, 405, 404, 200], statuses
    assert len(out.calls[0]) == 1 and out.columns["agent_reward"][0] == 1.0


#: an agent that sends what it should not, then one good call
PROBE = """
import json, urllib.request, urllib.error


def post(url, data, headers=None):
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        body = json.loads(error.read())
        assert "message" in body["error"], body
        return error.code, body


def probe(base_url, rollout_id, prompt, **columns):
    chat = base_url + "/chat/completions"
    good = json.dumps({"model": rollout_id, "messages": prompt, "max_tokens": 4}).encode()
    statuses = [
        post(chat, b"not json")[0],
        post(chat, json.dumps({"messages": "hello"}).encode())[0],
        post(chat, json.dumps({"messages": prompt, "n": "many"}).encode())[0],
        post(chat, json.dumps({"messages": prompt, "stream": True}).encode())[0],
        post(base_url.replace(rollout_id, "0" * 16) + "/chat/completions", good)[0],
        post(base_url + "/models", good)[0],
        post(base_url.rsplit("/v1", 1)[0] + "/v2/chat", good)[0],
        post(chat, good)[0],
    ]
    return {"agent_reward": 1.0, "statuses": statuses}
"""
