"""Generation ahead of training (``max_staleness``, ``weight_sync_steps``): the vLLM server generates the next
batches while the trainer trains, and the run stays exact.

Batches are counted over the whole run (k = 0, 1, ...). Batch k is generated from the weights after
``weights_version(k) = (max(0, k - N) // W) * W`` trained batches (N: ``max_staleness``, W:
``weight_sync_steps``), always, whatever the timing: when the trainer reaches a version (k batches trained, k a
multiple of W), it waits for the generations in flight to end (the weights never change under a request),
pushes its weights, and hands the server every batch that version is for; then it trains while they generate.
Each completion is drawn from its own key (``generation.completion_key``), so a batch's completions depend
only on the weights it was generated from: the run is a function of its config, on any number of processes.
With N = 1 this is the one-step-off overlap (a batch trains while the next is generated).

The generations run on one background thread per process (HTTP requests, tools, environments: nothing that
takes part in a collective or touches the training weights); scoring, the micro-batches and every collective
stay on the training thread when the batch is trained. A resumable checkpoint waits for the batches in flight
and saves their completions (``Ahead.saved``), so a resumed run trains on exactly what it would have.

Every checkpoint resumes. A batch whose weights the resumed run no longer has is generated from the weights it
resumes with, said in one line naming why (the run departs from the uninterrupted one there, and only there):
a checkpoint written by another number of processes (the batches in flight are per process), one written at a
stop while a batch's server was gone (the stop saves without it rather than wait), or a finished run
continued with more steps (a run generates nothing past its last step).

Tools, environments and ``rollout_func`` code on the generation thread share the process's global random
generators (``random``, NumPy's, torch's) with the training: code there that draws from them makes the
training's own draws (dropout, a data loader's shuffling) depend on timing. The checkpoint waits for the batches
in flight before it saves the generators, so what it saves is what the resumed run starts from; code that needs
randomness should keep its own generator (``random.Random(seed)``).
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.errors import UserError
from posttrain.generation.engine import EngineCopy
from posttrain.generation.types import Completions, GenerationStopped, Sampling
from posttrain.logs import say

#: where a process's batches generated ahead are kept in the loop state (saved with resumable checkpoints)
STATE_KEY = "ahead"


class OnPolicy:
    """The feed's batch source without generation ahead: each batch is generated when its step comes, from
    the weights of that step (its version is its own index). :class:`Ahead` is the other source; the feed
    calls either the same way."""

    def take_for(self, batch: int, state: Any) -> tuple[Completions | None, int]:
        """None: the feed generates the batch now."""
        return None, batch

    def version(self, batch: int) -> int:
        return batch

    def records(self, batch: int, version: int) -> dict[str, float]:
        return {}

    def other_weights(self) -> None:
        """Nothing is in flight, nothing to forget."""

    def close(self) -> None:
        pass


def weights_version(batch: int, staleness: int, every: int) -> int:
    """The trained batches whose weights batch ``batch`` is generated from (see the module docstring)."""
    return max(0, batch - staleness) // every * every


class Pinned:
    """A generation engine's view for the background thread: it samples from the weights the engine holds and
    never pushes (the training thread pushes, between batches)."""

    stale = False  # the training thread pushes, between batches

    def __init__(self, backend: EngineCopy) -> None:
        self.backend, self.name = backend, backend.name

    def generate(
        self,
        module: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool = False,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> Completions:
        if images and any(images):
            return self.backend.sample_images(prompts, sampling, keys, logprobs, images)
        return self.backend.sample(prompts, sampling, keys, logprobs)

    def push(self, module: torch.nn.Module) -> None:
        pass

    def mark_stale(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class InFlight:
    """A batch generated ahead: the weights it comes from and its completions (this process's slots)."""

    version: int
    future: Future[Completions]


class Ahead:
    """One process's batches generated ahead (see the module docstring). ``generate(k, backend)``: this
    process's completions of batch k from ``backend``; ``push()``: the training weights to the engine (every
    process takes part); ``total``: the run's generated batches."""

    def __init__(
        self,
        generate: Callable[[int, Any], Completions],
        backend: EngineCopy,
        push: Callable[[], None],
        staleness: int,
        every: int,
        total: int,
        world_size: int,
        background: bool = True,
    ) -> None:
        self.generate, self.push, self.pinned = generate, push, Pinned(backend)
        self.staleness, self.every, self.total, self.world_size = staleness, every, total, world_size
        self.pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-ahead") if background else None
        )
        self.pending: dict[int, InFlight] = {}
        self.launched = -1  # the last batch handed to the engine
        self.resumed: dict[str, Any] | None = (
            None  # what the checkpoint this run resumed from held (None: none)
        )
        self.missed_said = False
        self.engine_version: int | None = None  # the trained batches whose weights the engine holds
        self.waited = 0.0  # the trainer's wait for generations, since the last batch was taken
        self.idle_since: float | None = None  # when the generator last ran out of work
        self.idle = 0.0  # the generator's wait for weights, since the last batch was taken
        self.given_up: list[int] = []  # batches taken whose generation gave up at a stop (never trained)

    def version(self, batch: int) -> int:
        return weights_version(batch, self.staleness, self.every)

    # ------------------------------------------------------------------------------- the training thread

    def advance(self, trained: int) -> None:
        """``trained`` batches are trained: when that is a version some batches are generated from, wait for the
        generations in flight, push the weights and hand the engine those batches."""
        first = self.launched + 1
        # in order from the first not launched: those of this version, and (after a resume) those whose
        # version's weights this run never had (versions only grow with k: a prefix)
        due = [k for k in range(first, self.total) if self.version(k) <= trained]
        due = due[: next((i for i, k in enumerate(due) if k != first + i), len(due))]
        if not due:
            return
        missed = [k for k in due if self.version(k) < trained]
        if missed and not self.missed_said:
            say(self._missed_line(missed, trained))
            self.missed_said = True
        if self.engine_version != trained:
            self.settle()
            self.push()
            self.engine_version = trained
        for batch in due:
            self.pending[batch] = InFlight(trained, self._submit(batch))
            self.launched = batch

    def _submit(self, batch: int) -> Future[Completions]:
        """Batch ``batch`` to generate: on the background thread (a server), or when it is taken (an engine in
        this process, which the training thread must not share)."""
        if self.pool is not None:
            return self.pool.submit(self._run, batch)
        return Deferred(lambda: self._run(batch))

    def _missed_line(self, missed: list[int], trained: int) -> str:
        """Why batches ``missed`` come from the weights after ``trained`` batches instead of their own."""
        left_out = set((self.resumed or {}).get("left_out", []))
        if self.resumed is None:
            why = (
                "the checkpoint this run resumed from holds no batches generated ahead for it (they are saved per "
                "process: it was written by another number of processes, or without generation ahead)"
            )
        elif left_out & set(missed):
            why = (
                "they were in flight when the run that wrote the checkpoint stopped, and its servers were gone, "
                "so it saved without them"
            )
        else:
            why = "the checkpoint ends a run that generated nothing past its last step (a finished run continued)"
        batches = ", ".join(str(k) for k in missed[:4]) + (", ..." if len(missed) > 4 else "")
        return (
            f"generation ahead: batch(es) {batches} are generated from the weights after {trained} trained "
            f"batches, not after {self.version(missed[0])} as max_staleness {self.staleness} and weight_sync_steps "
            f"{self.every} would have them: {why}. From batch {missed[-1] + 1} on the rule holds again"
        )

    def take_for(self, batch: int, state: Any) -> tuple[Completions | None, int]:
        """The feed's one call for a step's batch: batch ``batch``'s completions and their weights' version.
        The run's first call attaches to its loop ``state`` (a resumed run's batches in flight restored from
        its checkpoint, every batch before ``batch`` trained; the checkpoints then save those in flight); each
        call hands the engine the batches whose weights are now trained, then waits for this one."""
        if not isinstance(state.rank_state.get(STATE_KEY), SavedAhead):
            self.restore(state.rank_state.get(STATE_KEY), batch, resumed=state.step > 0)
            # a checkpoint saves the batches in flight (at a stop, not those whose servers are gone)
            state.rank_state[STATE_KEY] = self.saved(lambda: bool(state.stop_reason))
        self.advance(batch)
        return self.take(batch)

    def take(self, batch: int) -> tuple[Completions, int]:
        """Batch ``batch``'s completions (waiting for them when they are not ready) and the weights' version
        they come from."""
        found = self.pending.pop(batch, None)
        if found is None:  # advance() hands out every batch up to the one trained: a bug if it did not
            raise RuntimeError(
                f"generated batch {batch} was not handed to the engine (launched: {self.launched})"
            )
        started = time.perf_counter()
        try:
            completions = found.future.result()
        except GenerationStopped:  # the stop took its servers: the checkpoint leaves it out
            self.given_up.append(batch)
            raise
        self.waited += time.perf_counter() - started
        return completions, found.version

    def records(self, batch: int, version: int) -> dict[str, float]:
        """The step's records of generating ahead (TRL's ``sample/staleness_*``: batches, here the same for
        every completion of the batch; the trainer's and the generator's waits in seconds)."""
        out = {
            "sample/staleness_mean": float(batch - version),
            "sample/staleness_max": float(batch - version),
            "time_waiting_generation": self.waited,
            "time_waiting_weights": self.idle,
        }
        self.waited = self.idle = 0.0
        return out

    def settle(self) -> None:
        """Wait until no generation is in flight (before the weights change, or an evaluation generates)."""
        started = time.perf_counter()
        for found in self.pending.values():
            with contextlib.suppress(GenerationStopped):  # raised again when its batch is taken
                found.future.result()
        self.waited += time.perf_counter() - started

    def forget_weights(self) -> None:
        """The engine was given other weights (an evaluation's): the next version is pushed again."""
        self.engine_version = None

    def other_weights(self) -> None:
        """Before the engine generates from other weights (an evaluation's, the current ones): the batches in
        flight are waited for, and the next version is pushed again."""
        self.settle()
        self.forget_weights()

    # ---------------------------------------------------------------------------------- resumable state

    def saved(self, stopping: Callable[[], bool] = lambda: False) -> SavedAhead:
        """What a resumable checkpoint keeps of this process's batches in flight (it waits for them; at a stop,
        ``stopping()`` true, not for those whose generation cannot end: see :class:`SavedAhead`)."""
        return SavedAhead(self, stopping)

    def restore(self, saved: dict[str, Any] | None, first: int, resumed: bool) -> None:
        """The batches a resumed run finds generated ahead in its checkpoint (``saved``; None: the checkpoint
        held none for this process), the run going on from batch ``first`` (every batch before it trained)."""
        self.launched = max(self.launched, first - 1)
        if not resumed:
            return
        self.resumed = saved
        for batch, (version, completions) in sorted((saved or {}).get("batches", {}).items()):
            if batch < first:
                continue
            done: Future[Completions] = Future()
            done.set_result(completions)
            self.pending[batch] = InFlight(version, done)
            self.launched = max(self.launched, batch)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------------------- the background

    def _run(self, batch: int) -> Completions:
        if self.idle_since is not None:
            self.idle += time.perf_counter() - self.idle_since
        try:
            return self.generate(batch, self.pinned)
        finally:
            self.idle_since = time.perf_counter()


class Deferred(Future):  # type: ignore[type-arg]
    """A generation run on the training thread when its result is first asked for."""

    def __init__(self, work: Callable[[], Completions]) -> None:
        super().__init__()
        self.work: Callable[[], Completions] | None = work

    def result(self, timeout: float | None = None) -> Completions:
        if self.work is not None:
            work, self.work = self.work, None
            try:
                self.set_result(work())
            except BaseException as exc:
                self.set_exception(exc)
        return super().result(timeout)


class SavedAhead:
    """Pickled into a checkpoint as a plain dict of the batches in flight (waiting for them first):
    ``{"world_size": W, "batches": {k: (version, completions)}, "left_out": [k, ...]}``. At a stop
    (``stopping()``), a batch whose generation cannot end (its backend has no server left, or it failed) is
    left out rather than waited for: the stop saves, and the resumed run generates it again (one line)."""

    def __init__(self, ahead: Ahead, stopping: Callable[[], bool] = lambda: False) -> None:
        self.ahead, self.stopping = ahead, stopping

    def wait(self) -> tuple[dict[int, tuple[int, Completions]], list[int]]:
        """The batches in flight, waited for; and those left out at a stop."""
        ahead, stopping = self.ahead, self.stopping()
        alive = ahead.pinned.backend.alive
        batches, left_out = {}, list(ahead.given_up)
        for k, found in sorted(ahead.pending.items()):
            future = found.future
            while stopping and not future.done() and alive():
                if isinstance(future, Deferred):  # generated here, on the training thread
                    with contextlib.suppress(Exception):
                        future.result()
                wait([future], timeout=0.5)
            if stopping and (not future.done() or future.exception() is not None):
                left_out.append(k)
                continue
            batches[k] = (found.version, future.result())
        if left_out:
            say(
                f"generation ahead: batch(es) {', '.join(map(str, left_out))} could not be generated before the "
                "stop (their servers are gone): the checkpoint is saved without them and the resumed run "
                "generates them again from its weights"
            )
        return batches, left_out

    def __reduce__(self) -> tuple[Any, ...]:
        ahead = self.ahead
        batches, left_out = self.wait()
        for completions in (c for _, c in batches.values()):
            for environment in completions.environments or []:
                try:
                    pickle.dumps(environment)
                except Exception as exc:
                    raise UserError(
                        f"a resumable checkpoint saves the batches generated ahead (max_staleness) with their "
                        f"environments, and {type(environment).__name__} cannot be pickled ({exc}); make it "
                        "picklable, or save checkpoints with max_staleness: 0"
                    ) from None
        return (dict, ({"world_size": ahead.world_size, "batches": batches, "left_out": left_out},))


def ahead_lines(config: Any, completions_per_process: int) -> list[str]:
    """The pre-flight report's line for a run that generates ahead (none otherwise)."""
    if not config.generates_ahead:
        return []
    staleness, every = config.max_staleness, config.weight_sync_steps
    in_flight = staleness + every - 1
    tokens = completions_per_process * config.max_completion_length * in_flight
    return [
        f"generation ahead: batch k from the weights after ({f'max(0, k - {staleness})' if staleness else 'k'}"
        f"{f' // {every}) * {every}' if every > 1 else ')'} trained batches (exact, whatever the timing); up to "
        f"{in_flight} batch(es) in flight, their completions in this process's memory: at most "
        f"{completions_per_process * in_flight} completions of {config.max_completion_length} tokens "
        f"(about {tokens * 8 / 2**20:.1f} MiB of token ids and log-probabilities)"
    ]
