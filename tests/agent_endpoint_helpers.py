"""A ReAct-style agent that owns its loop, written as a user would (the OpenAI client, the sandbox for its
code), and the prompts it answers, for the agent-endpoint tests."""

from __future__ import annotations

from pathlib import Path

#: think, act (run code in posttrain's sandbox), observe, answer: two engine calls, the observation added by
#: the agent in between; the reward is the answer's share of digits. A prompt asking to "wander" makes the
#: second call a fresh conversation (a new branch); one asking to "crash" raises after its first call. With a
#: file ``die_at_episode`` beside it holding N, the process kills itself after the first call of its N-th
#: episode.
REACT = """
import os, signal, threading
from pathlib import Path

from openai import OpenAI

from posttrain.sandbox.python_tool import python_tool

python = python_tool()  # the sandbox as this machine gives it whole (python_tool(strict=False): with what holds)

STARTED, LOCK = [0], threading.Lock()


def react(base_url, rollout_id, prompt, **columns):
    client = OpenAI(base_url=base_url, api_key="posttrain", max_retries=0)
    messages = [{"role": "system", "content": "Think, then act with code."}, *prompt]
    thought = client.chat.completions.create(model=rollout_id, messages=messages, max_tokens=6)
    text = thought.choices[0].message.content
    flag = Path(__file__).with_name("die_at_episode")  # SIGKILL the run in the middle of that episode
    with LOCK:
        STARTED[0] += 1
        if flag.exists() and STARTED[0] == int(flag.read_text()):
            flag.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
    if "crash" in prompt[-1]["content"]:
        raise RuntimeError("the agent's own bug")
    observation = python(f"print(len({text!r}) * 7)")
    if "wander" in prompt[-1]["content"]:
        messages = [{"role": "user", "content": f"Start over. Observation: {observation}"}]
    else:
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Observation: {observation}"},
        ]
    answer = client.chat.completions.create(model=rollout_id, messages=messages, max_tokens=6)
    final = answer.choices[0].message.content
    return {"agent_reward": sum(ch.isdigit() for ch in final) / max(len(final), 1), "observation": observation}
"""

#: the reward functions read what the agent returned (TRL's columns as keyword arguments)
FROM_AGENT = """
def from_agent(completions, agent_reward, **kwargs):
    return agent_reward
"""


def write_agent(root: Path) -> dict[str, str]:
    (root / "react.py").write_text(REACT)
    (root / "from_agent.py").write_text(FROM_AGENT)
    return {"agent_function": f"{root / 'react.py'}:react", "reward": f"{root / 'from_agent.py'}:from_agent"}
