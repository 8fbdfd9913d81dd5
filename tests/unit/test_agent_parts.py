"""The agent parts on their own: tool-call formats, tool and environment checks at validation, tools that
raise or hang, the sandbox against what model-written code tries, the code reward, and rewards that hang or
raise under each ``reward_errors``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.config.errors import ConfigError
from posttrain.config.rewards import CodeTestsReward, FunctionReward
from posttrain.generation.types import Completions
from posttrain.rewards.calls import RewardError
from posttrain.rewards.functions import build_rewards
from posttrain.rewards.guard import RewardGuard, score_all
from posttrain.rewards.workers import RewardWorkers
from posttrain.rollout.tools import ToolCall, ToolRunner, parse_hermes, parse_llama3_json, parse_mistral
from posttrain.testing import tool_task


def test_tool_calls_are_read_in_each_format() -> None:
    call = ToolCall("multiply", {"a": 2, "b": 3})
    assert parse_hermes('x <tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>') == [
        call
    ]
    assert (
        parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": 2,</tool_call>') == []
    )  # malformed
    assert parse_llama3_json('<|python_tag|>{"name": "multiply", "parameters": {"a": 2, "b": 3}}') == [call]
    assert parse_llama3_json("the answer is 6") == []
    assert parse_mistral('[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 2, "b": 3}}]') == [call]
    assert parse_mistral('[TOOL_CALLS]multiply[ARGS]{"a": 2, "b": 3}') == [call]


def test_tools_that_raise_hang_or_are_unknown_answer_with_their_error() -> None:
    def slow(x: int) -> int:
        import time

        time.sleep(5)
        return x

    def broken(x: int) -> int:
        raise ValueError("no such thing")

    runner = ToolRunner(timeout=0.5)
    table = {"slow": slow, "broken": broken, "multiply": tool_task.multiply}
    calls = [
        [ToolCall("multiply", {"a": 2, "b": 3}), ToolCall("broken", {"x": 1})],
        [ToolCall("slow", {"x": 1})],
        [ToolCall("nope", {})],
    ]
    results = runner.run(calls, [table] * 3)
    assert results[0] == [("multiply", "6", False), ("broken", "{'error': 'no such thing'}", True)]
    assert results[1] == [("slow", "{'error': 'timed out after 0.5 s'}", True)]
    assert results[2] == [("nope", "{'error': 'Tool nope not found.'}", True)]
    runner.close()


def _grpo(tmp_path: Path, **changes: object) -> dict:
    data = tool_task.write_rows(tmp_path / "p.jsonl", [tool_task.prompt_row(2, 3)])
    return {
        "type": "grpo",
        "model": {"name_or_path": "m"},
        "data": {"sources": [str(data)]},
        "rewards": [{"type": "exact_match"}],
        **changes,
    }


def test_bad_tools_and_environments_are_config_errors(tmp_path: Path) -> None:
    code = tmp_path / "agents.py"
    code.write_text(
        "def untyped(x):\n    '''Do.\n\n    Args:\n        x: it\n    '''\n    return x\n"
        "class NoReset:\n    def step(self, move: str) -> str:\n        '''Move.\n\n        Args:\n            move: where\n        '''\n        return move\n"
    )
    config = _grpo(
        tmp_path,
        tools=[f"{code}:untyped", f"{code}:missing"],
        environment_factory=f"{code}:NoReset",
        rollout_func=f"{code}:absent",
    )
    with pytest.raises(ConfigError) as found:
        load_config(data=config)
    text = str(found.value)
    assert "untyped" in text and "type hint" in text.lower()
    assert "has no function 'missing'" in text
    assert "NoReset has no reset method" in text
    assert "has no function 'absent'" in text


def test_an_agent_function_is_imported_at_load_and_alone(tmp_path: Path) -> None:
    code = tmp_path / "agent.py"
    code.write_text("def episode(base_url, rollout_id, prompt, **columns):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="has no function 'absent'"):
        load_config(data=_grpo(tmp_path, agent_function=f"{code}:absent"))
    with pytest.raises(ConfigError) as found:
        load_config(
            data=_grpo(tmp_path, agent_function=f"{code}:episode", tools=["python"], dynamic_sampling=True)
        )
    text = str(found.value)
    assert "agent_function: set with rollout_func, tools or environment_factory" in text
    assert "dynamic_sampling: true with multi-turn rollouts" in text
    config = load_config(data=_grpo(tmp_path, agent_function=f"{code}:episode", agent_max_calls=4))
    assert config.agent_max_calls == 4 and config.agent_timeout == 600


ENVIRONMENTS = """
import functools
from pathlib import Path


class Counter:
    def __init__(self, start: int = 0):
        self.count = start

    def reset(self, answer, **row):
        if answer == "boom":
            raise KeyError("no board for " + answer)

    def add(self, n: int) -> int:
        \"\"\"Add to the count.

        Args:
            n: how much
        \"\"\"
        if n < 0:
            raise ValueError("negative")
        self.count += n
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class Strict(Counter):
    def reset(self, prompt, answer):
        pass


def make() -> Counter:
    return Counter(1)


def make_unannotated():
    return Counter(2)


make_lambda = lambda: Counter(3)
make_partial = functools.partial(Counter, start=4)


def make_wrong() -> Counter:
    return Strict()


def make_failing():
    raise RuntimeError("no such board")


def make_with(size):
    return Counter(size)


class NoRow:
    def reset(self):
        pass


class NeedsArguments:
    def reset(self, **row):
        pass

    def get_reward(self, completion):
        return 1.0
"""


def test_environment_factories_and_signatures_are_checked_at_validation(tmp_path: Path) -> None:
    """TRL's callables are accepted (a class, a function declaring its class, one that does not, a lambda, a
    partial), their tools read from the class; a reset that takes no row, a get_reward that needs arguments, a
    factory that needs arguments or raises are config errors naming the class and line; the names a file
    offers leave out what it imported."""
    from posttrain.config.agents import environment_class, tool_schemas

    code = tmp_path / "envs.py"
    code.write_text(ENVIRONMENTS)
    for name in ("Counter", "make", "make_unannotated", "make_lambda", "make_partial"):
        config = load_config(data=_grpo(tmp_path, rewards=[], environment_factory=f"{code}:{name}"))
        assert environment_class(f"{code}:{name}").__name__ == "Counter", name
        [schemas] = tool_schemas([], config.environment_factory).values()
        assert [s["function"]["name"] for s in schemas] == ["add"], name
    config = _grpo(
        tmp_path,
        environment_factory={
            "a": f"{code}:NoRow",
            "b": f"{code}:NeedsArguments",
            "c": f"{code}:make_failing",
            "d": f"{code}:make_with",
            "e": f"{code}:Missing",
        },
    )
    with pytest.raises(ConfigError) as found:
        load_config(data=config)
    text = str(found.value)
    assert "NoRow.reset() (envs.py:59) cannot take a row" in text and "reset(self, **row)" in text
    assert "NeedsArguments.get_reward(completion) (envs.py:67) needs arguments" in text
    assert (
        "make_failing: calling it to read its environment's tools raised RuntimeError: no such board" in text
    )
    assert "at envs.py:51" in text
    assert "make_with(size) (envs.py:54) needs arguments" in text
    assert "has no environment 'Missing'" in text
    listed = text[text.index("(it has: ") :].split(")")[0]
    assert "Counter" in listed and "make_partial" in listed and "Path" not in listed


def test_environment_errors_name_the_users_class_and_line(tmp_path: Path) -> None:
    """At run time: a reset that raises, a row reset cannot take, a factory returning another class, a tool's
    own error (said once, the model still reading it) and get_reward's error each name the user's code."""
    from posttrain.errors import UserError
    from posttrain.rewards.functions import environment_rewards
    from posttrain.rollout.agent import Environments, reset

    code = tmp_path / "envs.py"
    code.write_text(ENVIRONMENTS)
    built = Environments(f"{code}:make").build({})
    assert built.count == 1
    with pytest.raises(
        UserError, match=r"Counter.reset \(envs.py:10\) raised KeyError: 'no board for boom' at "
    ):
        reset(built, {"prompt": "q", "answer": "boom"}, "p.jsonl row 3")
    with pytest.raises(
        UserError,
        match=r"Strict.reset\(prompt, answer\) \(envs.py:30\) cannot take the columns of p.jsonl row 3",
    ):
        reset(
            Environments(f"{code}:Strict").build({}),
            {"prompt": "q", "answer": "6", "hint": "x"},
            "p.jsonl row 3",
        )
    with pytest.raises(UserError, match=r"returned a Strict, not the Counter it declares"):
        Environments(f"{code}:make_wrong").build({})

    runner = ToolRunner(timeout=5)
    [[(_, text, failed)]] = runner.run([[ToolCall("add", {"n": -1})]], [{"add": built.add}])
    assert failed and "negative" in text
    assert runner.raised["add"].startswith("tool Counter.add (envs.py:14) raised ValueError: negative at ")
    [[(_, text, failed)]] = runner.run([[ToolCall("add", {"m": 1})]], [{"add": built.add}])
    assert (
        failed and "unexpected keyword argument 'm'" in text and len(runner.raised) == 1
    )  # the model's slip
    runner.close()

    config = load_config(data=_grpo(tmp_path, rewards=[], environment_factory=f"{code}:Counter"))
    [scored] = environment_rewards(config)
    assert scored.where().endswith("envs.py:25")  # the user's get_reward, not posttrain's wrapper


def test_the_code_reward_runs_the_last_block_against_the_tests() -> None:
    [reward] = build_rewards([CodeTestsReward(timeout=5)], 100)
    good = "Here:\n```python\ndef square(x):\n    return x * x\n```"
    half = "```python\ndef square(x):\n    return x * 2\n```"
    hang = "```python\ndef square(x):\n    while True:\n        pass\n```"
    tests = ["assert square(2) == 4", "assert square(3) == 9"]
    values = reward.function(completions=[good, half, hang, "no code"], tests=[tests] * 4)
    assert values == [1.0, 0.5, 0.0, 0.0]


HANGS = """
import time
def hangs(completions, answer, **kwargs):
    out = []
    for a in answer:
        if a == "6":
            time.sleep(120)
        out.append(1.0)
    return out
def raises(completions, answer, **kwargs):
    return [1 / 0 if a == "12" else 0.5 for a in answer]
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_rewards_that_hang_or_raise_do_not_stall_the_run(tmp_path: Path, workers: int) -> None:
    """One reward sleeps two minutes on one row, another raises on one: under ``unscorable`` their
    completions (and only those) are left out and counted, in this process and in workers (a hung worker
    is killed and replaced); under ``raise`` the run stops naming the function, its line and the row."""
    code = tmp_path / "guarded.py"
    code.write_text(HANGS)
    configs = [FunctionReward(function=f"{code}:hangs"), FunctionReward(function=f"{code}:raises")]
    rewards = build_rewards(configs, 10)
    answers = ["6", "6", "12", "20"]
    origins = [f"data.jsonl row {i}" for i in (1, 1, 2, 3)]
    pool = RewardWorkers(workers, configs, 10, 1.0, build_rewards) if workers else None
    guard = RewardGuard(timeout=1.0, errors="unscorable", workers=pool)
    import time

    started = time.perf_counter()
    values = score_all(rewards, ["q"] * 4, ["a"] * 4, [[1]] * 4, {"answer": answers}, origins, guard=guard)
    assert time.perf_counter() - started < 30
    assert guard.unscorable == {0, 1, 2}
    assert math.isnan(values[0][0]) and math.isnan(values[0][1]) and values[0][3] == 1.0
    assert math.isnan(values[1][2]) and values[1][3] == 0.5
    assert guard.take_counts() == {
        "hangs": {"timeouts": 2, "errors": 0},
        "raises": {"timeouts": 0, "errors": 1},
    }
    if pool is not None:
        assert pool.replaced >= 1  # the hung workers were killed and replaced
        pool.close()
    strict = RewardGuard(timeout=1.0, errors="raise")
    with pytest.raises(
        RewardError, match=rf"reward 'hangs' \({code}:3\) took more than 1 s .*data.jsonl row 1"
    ):
        score_all(rewards[:1], ["q"] * 4, ["a"] * 4, [[1]] * 4, {"answer": answers}, origins, guard=strict)
    with pytest.raises(
        RewardError, match=rf"reward 'raises' .* raised ZeroDivisionError: division by zero at {code}:11"
    ):
        score_all(rewards[1:], ["q"] * 4, ["a"] * 4, [[1]] * 4, {"answer": answers}, origins, guard=strict)


def test_tool_tokens_are_not_trained() -> None:
    from posttrain.rollout.feed import model_labels

    completions = Completions([[5, 6, 7, 8, 9]], [False], tool_mask=[[1, 1, 0, 0, 1]])
    assert model_labels(completions, 0) == [5, 6, -100, -100, 9]
    assert completions.model_lengths() == [3]


def test_the_python_tool_runs_code_and_its_schema_is_the_configs() -> None:
    from posttrain.config.agents import BUILTIN_SCHEMAS, schema_of
    from posttrain.sandbox.python_tool import python_tool

    python = python_tool()

    assert schema_of(python) == BUILTIN_SCHEMAS["python"]
    assert python("print(6 * 7)") == "42"
    assert "ZeroDivisionError" in python("1 / 0")


def test_a_reward_worker_that_dies_is_replaced(tmp_path: Path) -> None:
    code = tmp_path / "dies.py"
    code.write_text(
        "import os\ndef dies(completions, answer, **kw):\n    if '6' in answer:\n        os._exit(3)\n    return [1.0] * len(completions)\n"
    )
    configs = [FunctionReward(function=f"{code}:dies")]
    pool = RewardWorkers(1, configs, 10, 30.0, build_rewards)
    guard = RewardGuard(timeout=30.0, errors="unscorable", workers=pool)
    rewards = build_rewards(configs, 10)
    values = score_all(
        rewards,
        ["q"] * 3,
        ["a"] * 3,
        [[1]] * 3,
        {"answer": ["6", "7", "8"]},
        ["r 1", "r 2", "r 3"],
        guard=guard,
    )
    assert math.isnan(values[0][0]) and values[0][1:] == [1.0, 1.0]
    assert (
        guard.take_counts() == {"dies": {"timeouts": 0, "errors": 1}} and pool.replaced == 1
    )  # a time limit and unscorable: each completion its own call from the start, the row's worker replaced
    strict = RewardGuard(timeout=30.0, errors="raise", workers=pool)
    with pytest.raises(
        RewardError,
        match=r"reward 'dies' \(.*dies.py:2\): its worker process died \(exit code 3\), scoring the completions of r 1",
    ):
        score_all(rewards, ["q"], ["a"], [[1]], {"answer": ["6"]}, ["r 1"], guard=strict)
    pool.close()
