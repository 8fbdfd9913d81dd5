"""An agent that owns its loop, trained with ``agent_function`` (examples/grpo-react-agent.yaml): it asks the
model through posttrain's OpenAI-compatible endpoint, checks the answer with code run in posttrain's sandbox,
and on a wrong answer says so and asks again, up to two attempts; its reward is whether the last answer is
right. Any OpenAI client works the same way (``pip install openai``, or ``posttrain[agents]``)."""

from __future__ import annotations

from typing import Any

from openai import OpenAI

from posttrain.sandbox.python_tool import python_tool

#: the sandbox as this machine gives it whole (``python_tool(strict=False)``: with what holds)
python = python_tool()


def solve(base_url: str, rollout_id: str, prompt: list[dict[str, str]], answer: str, **columns: Any) -> float:
    """One episode: ``base_url`` is this episode's endpoint, ``prompt`` the row's messages, ``answer`` its
    column; returns the reward."""
    client = OpenAI(base_url=base_url, api_key="posttrain", max_retries=0)
    messages = list(prompt)
    right = False
    for _attempt in range(2):
        reply = client.chat.completions.create(model=rollout_id, messages=messages, max_tokens=10)
        text = reply.choices[0].message.content.strip()
        # the check runs as code in the sandbox, as a coding agent's tests would
        verdict = python(f"print({text!r} == {answer!r})")
        right = verdict.strip() == "True"
        if right:
            break
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "That is not it. Reverse the digits again."},
        ]
    return 1.0 if right else 0.0


def agent_reward(
    completions: list[Any], agent_reward: list[float | None], **kwargs: Any
) -> list[float | None]:
    """The reward function of the run: what each episode returned (TRL's columns arrive as arguments)."""
    return agent_reward
