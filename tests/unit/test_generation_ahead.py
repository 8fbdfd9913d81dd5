"""Generation ahead of training on its own (``rollout/ahead.py``): the keys' checks, the rule saying which
weights each batch comes from, the order in which batches are handed to the engine and the weights pushed,
and the off-policy correction of a known lag computed by hand on a real update of the tiny model."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.config import load_config
from posttrain.config.errors import ConfigError
from posttrain.generation.types import Completions
from posttrain.rollout.ahead import Ahead, weights_version


def _grpo(tmp_path: Path, **changes: object) -> dict:
    return {
        "type": "grpo",
        "model": {"name_or_path": "m"},
        "data": {"sources": [str(tmp_path / "p.jsonl")]},
        "rewards": [{"type": "exact_match"}],
        **changes,
    }


def test_the_keys_are_checked(tmp_path: Path) -> None:
    for changes, said in (
        ({"max_staleness": 1}, "max_staleness: 1 with use_vllm: false"),
        ({"max_staleness": 2, "use_vllm": True}, "max_staleness: 2 with vllm_mode: colocate"),
        ({"weight_sync_steps": 2}, "weight_sync_steps: 2 with use_vllm: false"),
        (
            {
                "max_staleness": 1,
                "use_vllm": True,
                "vllm_mode": "server",
                "vllm_importance_sampling_correction": False,
            },
            "vllm_importance_sampling_correction: false with max_staleness: 1",
        ),
        ({"max_staleness": -1}, "max_staleness"),
    ):
        with pytest.raises(ConfigError) as found:
            load_config(data=_grpo(tmp_path, **changes))
        assert said in str(found.value), str(found.value)
    config = load_config(data=_grpo(tmp_path, max_staleness=1, use_vllm=True, vllm_mode="server"))
    assert config.generates_ahead and not load_config(data=_grpo(tmp_path)).generates_ahead


def test_which_weights_each_batch_comes_from() -> None:
    assert [weights_version(k, 0, 1) for k in range(5)] == [0, 1, 2, 3, 4]  # the synchronous run
    assert [weights_version(k, 1, 1) for k in range(5)] == [0, 0, 1, 2, 3]  # one batch behind
    assert [weights_version(k, 2, 1) for k in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [weights_version(k, 0, 3) for k in range(7)] == [0, 0, 0, 3, 3, 3, 6]  # weight_sync_steps 3
    assert [weights_version(k, 1, 2) for k in range(7)] == [0, 0, 0, 2, 2, 4, 4]


@pytest.mark.parametrize(("staleness", "every", "background"), [(1, 1, True), (2, 1, True), (1, 2, False)])
def test_batches_are_handed_over_after_their_weights_and_never_under_a_push(
    staleness: int, every: int, background: bool
) -> None:
    """Trained as the feed trains (advance to k, take batch k): each batch is generated from the weights
    the rule names, a push waits until no generation is in flight, and every batch is generated once."""
    trained = [0]  # the weights the engine holds: the trained batches at the last push
    held: list[int] = []
    running = threading.Event()
    log: list[tuple[str, int]] = []

    def generate(batch: int, backend: object) -> Completions:
        running.set()
        log.append(("generate", batch))
        held.append(trained[0])
        running.clear()
        return Completions([[batch]], [False])

    def push() -> None:
        assert not running.is_set(), "a push while a generation ran"
        log.append(("push", now[0]))
        trained[0] = now[0]

    now = [0]
    engine = SimpleNamespace(name="engine")  # generate() above stands for its sampling
    ahead = Ahead(generate, engine, push, staleness, every, total=9, world_size=1, background=background)
    for batch in range(9):
        now[0] = batch
        ahead.advance(batch)
        completions, version = ahead.take(batch)
        assert completions.ids == [[batch]] and version == weights_version(batch, staleness, every)
    ahead.close()
    generated = [b for kind, b in log if kind == "generate"]
    assert sorted(generated) == list(range(9))
    assert held == [weights_version(b, staleness, every) for b in generated]
    assert [b for kind, b in log if kind == "push"] == sorted(
        {weights_version(b, staleness, every) for b in range(9)}
    )


class _Engine:
    """An engine for :class:`Ahead` on its own: it holds the weights of the last push (the trained batches),
    and a batch's completion records them."""

    def __init__(self) -> None:
        self.name, self.holds, self.now = "engine", -1, 0

    def generate(self, batch: int, backend: object) -> Completions:
        return Completions([[batch, self.holds]], [False])

    def push(self) -> None:
        self.holds = self.now

    def alive(self) -> bool:
        return True


def _train(ahead: Ahead, engine: _Engine, batches: range) -> dict[int, int]:
    """Trains ``batches`` as the feed does (advance to k, take k): the weights each one came from."""
    found = {}
    for batch in batches:
        engine.now = batch
        ahead.advance(batch)
        completions, version = ahead.take(batch)
        assert completions.ids[0][1] == version, (batch, completions.ids, version)  # the weights it says
        found[batch] = version
    return found


@pytest.mark.parametrize(("staleness", "every"), [(0, 2), (0, 3), (1, 1), (1, 2), (2, 2), (2, 3)])
def test_every_checkpoint_resumes_to_the_uninterrupted_run(
    staleness: int, every: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint after any batch (max_staleness 0 with weight_sync_steps > 1 included: at a multiple of it
    nothing is in flight) resumes in a fresh process to the uninterrupted run's weights for every batch."""
    import pickle

    caplog.set_level(logging.INFO, logger="posttrain")
    total = 10
    engine = _Engine()
    whole = _train(
        Ahead(engine.generate, engine, engine.push, staleness, every, total, 1, False), engine, range(total)
    )
    assert whole == {k: weights_version(k, staleness, every) for k in range(total)}
    for stop in range(1, total):
        engine = _Engine()
        first = Ahead(engine.generate, engine, engine.push, staleness, every, total, 1, False)
        first.restore(None, 0, resumed=False)
        _train(first, engine, range(stop))
        saved = pickle.loads(pickle.dumps(first.saved()))  # as the checkpoint writes and reads it
        engine = _Engine()  # a new process: the engine holds the files' weights
        engine.holds = -1
        again = Ahead(engine.generate, engine, engine.push, staleness, every, total, 1, False)
        again.restore(saved, stop, resumed=True)
        assert _train(again, engine, range(stop, total)) == {k: whole[k] for k in range(stop, total)}, stop
    assert "generation ahead:" not in caplog.text


@pytest.mark.parametrize(("staleness", "every"), [(0, 2), (1, 1), (2, 2)])
def test_a_finished_run_continued_or_resumed_elsewhere_goes_on_and_says_why(
    staleness: int, every: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished run continued with more steps, or a checkpoint read without its batches in flight (another
    process count), goes on: the batches whose weights are gone come from the resumed weights, one line says
    which and why, and from the next version on the rule holds again."""
    import pickle

    caplog.set_level(logging.INFO, logger="posttrain")
    engine = _Engine()
    first = Ahead(engine.generate, engine, engine.push, staleness, every, 6, 1, False)
    _train(first, engine, range(6))
    saved = pickle.loads(pickle.dumps(first.saved()))
    for held, why in ((saved, "a finished run continued"), (None, "another number of processes")):
        engine = _Engine()
        more = Ahead(engine.generate, engine, engine.push, staleness, every, 12, 1, False)
        more.restore(held, 6, resumed=True)
        found = _train(more, engine, range(6, 12))
        said = caplog.text
        caplog.clear()
        behind = [k for k in range(6, 12) if weights_version(k, staleness, every) < 6]
        assert all(found[k] == 6 for k in behind)
        assert all(found[k] == weights_version(k, staleness, every) for k in range(6, 12) if k not in behind)
        if behind:
            assert said.count("generation ahead:") == 1 and why in said, said
            assert f"batch(es) {', '.join(map(str, behind))} are generated from the weights after 6" in said
        else:
            assert "generation ahead:" not in said


def test_a_stop_saves_without_a_batch_whose_servers_are_gone(caplog: pytest.LogCaptureFixture) -> None:
    """At a stop, a batch still generating on a backend with no server left is not waited for: the checkpoint
    holds the others and names it; the resumed run generates it again and says why. A checkpoint that is not a
    stop waits for it."""
    import pickle

    caplog.set_level(logging.INFO, logger="posttrain")
    release = threading.Event()
    engine = _Engine()
    alive = [True]
    backend = SimpleNamespace(name="server", alive=lambda: alive[0])

    def generate(batch: int, _: object) -> Completions:
        if batch == 3:
            release.wait(30)
            raise RuntimeError("every server is lost")
        return engine.generate(batch, _)

    ahead = Ahead(generate, backend, engine.push, 2, 1, 8, 1, True)
    _train(ahead, engine, range(2))  # batches 2 and 3 are in flight, 3 on a server that is gone
    alive[0] = False
    waited = threading.Timer(5.0, release.set)  # the checkpoint must not wait for it
    waited.start()
    saved = pickle.loads(pickle.dumps(ahead.saved(lambda: True)))
    assert not release.is_set()
    waited.cancel()
    release.set()
    ahead.close()
    assert sorted(saved["batches"]) == [2] and saved["left_out"] == [3]
    assert "batch(es) 3 could not be generated before the stop" in caplog.text
    engine = _Engine()
    again = Ahead(engine.generate, engine, engine.push, 2, 1, 8, 1, False)
    again.restore(saved, 2, resumed=True)
    found = _train(again, engine, range(2, 8))
    assert found[2] == 0 and found[3] == 2  # batch 3 from the resumed weights, said so
    assert found == {2: 0, 3: 2, 4: 2, 5: 3, 6: 4, 7: 5}
    assert "in flight when the run that wrote the checkpoint stopped" in caplog.text


def test_a_batch_given_up_at_a_stop_is_left_out_and_generated_again(caplog: pytest.LogCaptureFixture) -> None:
    """The batch a step waits for gives up at a stop (``GenerationStopped``: its servers are gone): settling
    before a push does not raise, taking it does, and the checkpoint leaves it out with those still in flight;
    the resumed run generates both from its weights."""
    import pickle

    from posttrain.generation.types import GenerationStopped

    caplog.set_level(logging.INFO, logger="posttrain")
    engine = _Engine()
    backend = SimpleNamespace(name="server", alive=lambda: False)

    def generate(batch: int, _: object) -> Completions:
        if batch >= 2:
            raise GenerationStopped("the run is stopping and every vLLM server is lost")
        return engine.generate(batch, _)

    ahead = Ahead(generate, backend, engine.push, 1, 1, 8, 1, True)
    _train(ahead, engine, range(2))
    engine.now = 2
    ahead.advance(2)  # settles (batch 2 gave up), pushes, launches batch 3
    with pytest.raises(GenerationStopped):
        ahead.take(2)
    saved = pickle.loads(pickle.dumps(ahead.saved(lambda: True)))
    ahead.close()
    assert saved["batches"] == {} and sorted(saved["left_out"]) == [2, 3]
    again = Ahead(engine.generate, engine, engine.push, 1, 1, 8, 1, False)
    again.restore(saved, 2, resumed=True)
    assert _train(again, engine, range(2, 5)) == {2: 2, 3: 2, 4: 3}
    assert "in flight when the run that wrote the checkpoint stopped" in caplog.text


def test_a_known_lag_is_corrected_by_the_engines_log_probabilities(tiny_model_dir: Path) -> None:
    """The engine sampled from the weights before an update (a lag of one); the trainer's log-probabilities
    are the weights after it. The correction's weights are min(exp(l_new - l_engine), C) per token, computed by
    hand here on a real SGD step of the tiny model: not 1, so the lag is corrected, not ignored."""
    from transformers import AutoModelForCausalLM

    from posttrain.methods.grpo.losses import SamplingCorrection, sampling_weights
    from posttrain.models.token_logps import token_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 23, 42, 8, 99, 3], [7, 7, 19, 64, 2, 11, 5]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    batch["labels"][:, :3] = -100  # the prompt
    from posttrain.data.samples import target_labels

    mask = (target_labels(batch) != -100).float()
    with torch.no_grad():
        engine = token_logps(model, batch)[0]  # the weights the batch was generated from
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = -(token_logps(model, batch)[0] * mask).sum()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        trainer = token_logps(model, batch)[0]  # one update later
    correction = SamplingCorrection("token_truncate", None, 3.0)
    weights = sampling_weights(correction, trainer, engine, mask)
    for row in range(2):
        for position in range(mask.shape[1]):
            if mask[row, position]:
                expected = min(math.exp(float(trainer[row, position] - engine[row, position])), 3.0)
                assert float(weights[row, position]) == pytest.approx(expected, rel=1e-6)
    assert float((weights[mask.bool()] - 1).abs().max()) > 1e-3  # the lag shows
