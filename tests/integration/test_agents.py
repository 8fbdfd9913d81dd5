"""Agents on the tiny model taught to call a tool: multi-turn grpo with tools (the tools run, their tokens
out of the loss), exact after SIGKILL + auto_resume and on two processes, environments with their reward,
a hand-written rollout, distill with tools, and a reward that hangs on one row not stalling the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.testing import tool_task
from tests.agent_helpers import agent_config, teach_tool_calls, tool_prompts
from tests.integration.helpers import metrics, train
from tests.resume_helpers import assert_same_continuation, cli, kill_and_resume, last_metrics

pytestmark = pytest.mark.integration

ROLLOUT = """
def rollout(prompts, trainer):
    tokenizer = trainer.tokenizer
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, return_dict=True)["input_ids"] for p in prompts]
    out = trainer.generate(ids)
    return {
        "prompt_ids": ids,
        "completion_ids": out["completion_ids"],
        "logprobs": None,
        "env_mask": [[1] * len(c) for c in out["completion_ids"]],
        "turns": [1] * len(ids),
    }

def saw_turns(completions, turns, **kwargs):
    return [float(t) for t in turns]
"""

HANG = """
import os
import time
from pathlib import Path

def hangs_on_one(completions, answer, **kwargs):
    marker = Path(__file__).with_suffix(".row")  # the first row it sees is the one it hangs on
    try:  # the workers score completions at once: one of them claims the row
        claimed = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(claimed, answer[0].encode())
        os.close(claimed)
    except FileExistsError:
        while not marker.read_text():  # claimed by another worker a moment ago
            time.sleep(0.01)
    if marker.read_text() in answer:
        time.sleep(120)
    return [0.0] * len(completions)
"""


@pytest.fixture(scope="module")
def tool_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("agents")
    return {
        "model": teach_tool_calls(tiny_model_dir, root),
        "train": tool_prompts(root, 64, seed=1),
        "eval": tool_prompts(root, 8, seed=2),
    }


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]


def test_grpo_with_a_tool_runs_it_and_trains_only_the_model_tokens(
    tool_model: dict[str, Path], tmp_path: Path
) -> None:
    config = agent_config(
        tool_model["model"],
        tool_model["train"],
        tmp_path / "run",
        train_iters=3,
        data={"eval_sources": [str(tool_model["eval"])]},
        eval_interval=3,
    )
    train(config)
    records = [r for r in metrics(config) if "reward" in r]
    assert len(records) == 3
    assert all(r["tools/call_frequency"] > 0 for r in records), records
    assert all(r["tools/failure_frequency"] == 0 for r in records)
    assert "eval_reward" in metrics(config)[-1]
    lines = _lines(tmp_path / "run")
    called = [line for line in lines if any(m["role"] == "tool" for m in line["messages"])]
    assert called, lines[:2]
    first = called[0]["messages"]
    call = first[0]["tool_calls"][0]["function"]
    assert first[1]["content"] == str(call["arguments"]["a"] * call["arguments"]["b"])  # the tool ran
    # the logged length counts the model's tokens only: below the tokens of the whole exchange
    assert records[0]["completions/mean_length"] < config["max_completion_length"]


@pytest.mark.slow  # make test-slow (CI runs it)
def test_tool_rollouts_resume_exactly_after_a_kill(tool_model: dict[str, Path], tmp_path: Path) -> None:
    base = agent_config(tool_model["model"], tool_model["train"], tmp_path / "unused")
    results = kill_and_resume(base, tmp_path, nproc=1, kill_at=2, total=4)
    assert_same_continuation(results, 2, 4)
    reference, resumed = results["reference_metrics"], results["resumed_metrics"]
    for step in (3, 4):
        assert reference[step]["reward"] == resumed[step]["reward"]
        assert reference[step]["tools/call_frequency"] == resumed[step]["tools/call_frequency"]


@pytest.mark.distributed
def test_one_and_two_processes_draw_the_same_trajectories(
    tool_model: dict[str, Path], tmp_path: Path
) -> None:
    """Two data-parallel processes, and two processes splitting each row (``sequence_parallel_size: 2``:
    each generates half of the group's trajectories with the tools, the training rows split after), give one
    process's trajectories, rewards and losses."""
    runs = {}
    layouts = {"one": (1, 2, 1), "two": (2, 1, 1), "split": (2, 2, 2)}  # processes, accumulation, SP
    for name, (nproc, accumulation, sp) in layouts.items():
        out = tmp_path / name
        config = agent_config(
            tool_model["model"],
            tool_model["train"],
            out,
            train_iters=3,
            gradient_accumulation_steps=accumulation,
            sequence_parallel_size=sp,
        )
        done = cli(config, tmp_path / f"{name}.yaml", nproc=nproc, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("each sample split over 2 processes" in done.stdout) == (sp == 2), done.stdout[-3000:]
        runs[name] = last_metrics(out)
    for name in ("two", "split"):
        for step in (1, 2, 3):
            one, other = runs["one"][step], runs[name][step]
            assert one["tools/call_frequency"] == other["tools/call_frequency"], (name, step)
            assert one["completions/mean_length"] == other["completions/mean_length"], (name, step)
            assert one["reward"] == other["reward"], (name, step)
            assert abs(one["loss"] - other["loss"]) <= 1e-6, (name, step, one["loss"], other["loss"])


OBSERVING = """
from posttrain.testing.tool_task import Calculator


class Observing(Calculator):
    def reset(self, answer, **row):
        super().reset(answer, **row)
        return "Use the calculator."
"""


def test_an_environment_gives_tools_and_the_reward(tool_model: dict[str, Path], tmp_path: Path) -> None:
    """The environment's methods are the tools and its get_reward a reward; the completions log holds the
    prompt as the model saw it (the tools' schemas, an observation reset returned) beside the data's."""
    code = tmp_path / "observing.py"  # a user's file: a subclass of the task's environment
    code.write_text(OBSERVING)
    config = agent_config(
        tool_model["model"],
        tool_model["train"],
        tmp_path / "run",
        train_iters=2,
        tools=[],
        rewards=[],
        environment_factory=tool_task.environment_entry(),
    )
    train(config)
    records = [r for r in metrics(config) if "reward" in r]
    assert all("rewards/Calculator/mean" in r for r in records), records[0]
    assert any(r["tools/call_frequency"] > 0 for r in records)
    lines = _lines(tmp_path / "run")
    tool_answers = [m for line in lines for m in line["messages"] if m["role"] == "tool"]
    assert tool_answers  # the environment's method ran as the tool
    assert all("multiply" in line["prompt_as_seen"] for line in lines)  # the schemas, as the template renders
    observed = agent_config(
        tool_model["model"],
        tool_model["train"],
        tmp_path / "observed",
        train_iters=1,
        tools=[],
        rewards=[],
        environment_factory=f"{code}:Observing",
    )
    train(observed)
    for line in _lines(tmp_path / "observed"):
        assert "Use the calculator." in line["prompt_as_seen"] and "Use the calculator." not in str(
            line["prompt"]
        )


BROKEN = """
class Broken:
    def reset(self, answer, **row):
        raise ValueError("no board for " + answer)

    def get_reward(self) -> float:
        return 0.0
"""


def test_an_environment_error_stops_the_run_in_one_line(tool_model: dict[str, Path], tmp_path: Path) -> None:
    """An environment with no tools is said; a reset that raises stops the run with exit code 2 and one line
    naming the class, its line and the row, no traceback."""
    code = tmp_path / "broken.py"
    code.write_text(BROKEN)
    config = agent_config(
        tool_model["model"],
        tool_model["train"],
        tmp_path / "run",
        train_iters=1,
        tools=[],
        rewards=[],
        environment_factory=f"{code}:Broken",
    )
    done = cli(config, tmp_path / "run.yaml")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "environment Broken (broken.py:2) has no tools" in done.stdout + done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "Broken.reset (broken.py:3) raised ValueError: no board for" in error and "row" in error, error
    assert "Traceback" not in done.stderr


def test_a_hand_written_rollout(tool_model: dict[str, Path], tmp_path: Path) -> None:
    code = tmp_path / "rollout.py"
    code.write_text(ROLLOUT)
    config = agent_config(
        tool_model["model"],
        tool_model["train"],
        tmp_path / "run",
        train_iters=2,
        tools=[],
        rollout_func=f"{code}:rollout",
        rewards=[f"{code}:saw_turns"],
    )
    train(config)
    records = [r for r in metrics(config) if "reward" in r]
    assert [r["reward"] for r in records] == [1.0, 1.0]  # the rollout's extra column reached the reward


def test_distill_with_tools(tool_model: dict[str, Path], tmp_path: Path) -> None:
    config = agent_config(tool_model["model"], tool_model["train"], tmp_path / "run", train_iters=2)
    for key in ("rewards", "num_generations"):
        config.pop(key)
    config.update(type="distill", teacher_model_name_or_path=str(tool_model["model"]), micro_batch_size=4)
    train(config)
    records = [r for r in metrics(config) if "loss" in r and "iter" in r]
    assert records and all("tools/call_frequency" in r for r in records)
    assert any(r["tools/call_frequency"] > 0 for r in records)


def test_a_reward_that_hangs_on_one_row_does_not_stall_the_run(
    tool_model: dict[str, Path], tmp_path: Path
) -> None:
    code = tmp_path / "hang.py"
    code.write_text(HANG)
    config = agent_config(
        tool_model["model"],
        tool_model["train"],
        tmp_path / "run",
        train_iters=2,
        tools=[],
        rewards=[{"type": "exact_match"}, f"{code}:hangs_on_one"],
        reward_timeout=1.0,
        reward_num_workers=1,
        reward_errors="unscorable",
        max_completion_length=8,
    )
    train(config)
    records = [r for r in metrics(config) if "reward" in r]
    assert sum(r["rewards/hangs_on_one/timeouts"] for r in records) == 4, [
        (r["rewards/hangs_on_one/timeouts"], r["reward"]) for r in records
    ]
    assert all(r["rewards/exact_match/errors"] == 0 for r in records)


def test_tool_and_environment_from_the_page(tool_model: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    import yaml

    from tests.integration.test_extending import examples

    files = examples()
    (tmp_path / "agent_tools.py").write_text(files["agent_tools.py"])
    monkeypatch.chdir(tmp_path)  # the page's paths are relative to where posttrain runs
    page = yaml.safe_load(files["agent.yaml"])
    runs = {}
    for name, changes in {
        "tool": {},
        "environment": {"tools": [], "rewards": [], "environment_factory": "agent_tools.py:Calculator"},
    }.items():
        config = agent_config(tool_model["model"], tool_model["train"], tmp_path / name, train_iters=2)
        config.update({**page, **changes})
        train(config)
        runs[name] = [r for r in metrics(config) if "reward" in r]
    assert any(r["tools/call_frequency"] > 0 for r in runs["tool"])
    assert all("rewards/Calculator/mean" in r for r in runs["environment"])


def test_the_preflight_report_shows_a_prompt_with_its_tools(
    tool_model: dict[str, Path], tmp_path: Path, capsys
) -> None:
    import yaml

    from posttrain.cli import main

    config = agent_config(
        tool_model["model"], tool_model["train"], tmp_path / "run", tools=[tool_task.tool_entry(), "python"]
    )
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["preprocess", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tools: multiply, python" in out and "calls read as hermes" in out
    assert "sandbox: " in out and "namespaces: user" in out and "memory per run" in out
    assert "  | tool multiply(a, b): Multiply two integers." in out  # the rendered prompt, its tools included
    # the code reward runs model code too: its run says what the sandbox holds, tools or not
    scored = agent_config(tool_model["model"], tool_model["train"], tmp_path / "scored", tools=[])
    scored["rewards"] = [{"type": "code_tests", "column": "answer"}]
    path.write_text(yaml.safe_dump(scored))
    assert main(["preprocess", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sandbox: " in out and "tools:" not in out
    # a template that drops the tools: refused in one line naming the presets that render them
    dropped = agent_config(
        tool_model["model"], tool_model["train"], tmp_path / "dropped", tools=[tool_task.tool_entry()]
    )
    dropped["tokenizer"] = {"chat_template": "chatml"}
    path.write_text(yaml.safe_dump(dropped))
    assert main(["preprocess", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        "does not render tools" in err and "tokenizer.chat_template: hermes" in err and "Traceback" not in err
    )
