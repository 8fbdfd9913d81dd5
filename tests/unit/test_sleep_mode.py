"""Sleep mode keeps the weights it samples from (issue #59 point 5), shown with a stand-in for ``vllm.LLM`` that
keeps vLLM's documented semantics: ``sleep(level=1)`` moves the weights to host memory and drops the KV cache,
``sleep(level=2)`` drops both, ``wake_up(tags)`` wakes what it names (the weights from the host copy, or
nothing left to restore after level 2), and generating while any part sleeps, or from dropped weights, is
visible in the answer. A colocated engine pushes once, then samples several times from that push: a second
batch generated ahead (``weight_sync_steps`` > 1, ``ahead.Pinned``) and the harness block's greedy batch."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

DROPPED = "whatever the GPU memory held"


class StandInLLM:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.device_weights: str = "the files' weights"
        self.host_weights: str | None = None
        self.asleep: set[str] = set()
        self.levels: list[int] = []

    def sleep(self, level: int = 1) -> None:
        self.levels.append(level)
        self.host_weights = self.device_weights if level == 1 else None
        self.device_weights = DROPPED
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and "weights" in self.asleep:
            self.device_weights = self.host_weights or DROPPED
        self.asleep -= set(tags)

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[dict[str, list[str]]]:
        assert method == "posttrain_reload" and "weights" not in self.asleep, "a push into sleeping weights"
        weights = dict(kwargs["weights_iterator"])
        self.device_weights = f"pushed {float(sum(t.sum() for t in weights.values())):.6f}"
        return [{"refreshed": sorted(weights), "missing": []}]

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, requests: list[Any], params: list[Any], **kwargs: Any) -> list[Any]:
        woken = "asleep: " + ", ".join(sorted(self.asleep)) if self.asleep else self.device_weights
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[2], logprobs=None, text=woken)])
            for _ in requests
        ]


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm")
    fake.LLM = StandInLLM  # type: ignore[attr-defined]
    fake.SamplingParams = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)


def test_sleep_mode_keeps_the_pushed_weights_for_every_sample_until_the_next_push(stand_in: None) -> None:
    from posttrain.generation import vllm_engine
    from posttrain.generation.types import Sampling
    from posttrain.generation.vllm_engine import EngineSettings, VLLMEngine
    from posttrain.rollout.ahead import Pinned

    seen: list[str] = []

    def completions_of(outputs: list[Any], stops: Any, logprobs: bool) -> Any:
        seen.append(outputs[0].outputs[0].text)
        return SimpleNamespace(ids=[[2]] * len(outputs))

    vllm_engine.completions_of, kept = completions_of, vllm_engine.completions_of  # type: ignore[assignment]
    try:
        module = torch.nn.Linear(4, 4)
        settings = EngineSettings({"model": "m", "enable_sleep_mode": True}, said="stand-in")
        backend = VLLMEngine(settings, module, [2])
        pushed = backend.llm.device_weights if not backend.llm.asleep else backend.llm.host_weights
        assert pushed and pushed.startswith("pushed")
        sampling = Sampling(4, 1.0)
        backend.sample([[1, 2, 3]], sampling, [7], False)  # the first batch of the push
        with torch.no_grad():
            module.weight.add_(1.0)  # an update: training goes on, the engine keeps its push
        Pinned(backend).generate(module, [[1, 2, 3]], sampling, [8])  # a second batch of the same push
        backend.sample([[4, 5]], Sampling(4), None, False)  # the harness block's greedy batch
        assert seen == [pushed, pushed, pushed], seen
        assert set(backend.llm.levels) == {1}  # the weights were never dropped
        backend.generate(module, [[1, 2, 3]], sampling, [9])  # stale? no: nothing marked it
        backend.mark_stale()
        backend.generate(module, [[1, 2, 3]], sampling, [9])  # the next push, then its batch
        assert seen[-2] == pushed and seen[-1].startswith("pushed") and seen[-1] != pushed, seen
    finally:
        vllm_engine.completions_of = kept  # type: ignore[assignment]
