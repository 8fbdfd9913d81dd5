"""Agents that own their loop (``agent_function``): an OpenAI-compatible endpoint in front of the run's
generation engine, and the trajectories built from what the engine saw and sampled.

For a batch, each completion slot is an episode: the user's function is called on a thread of its own with
``base_url`` (``http://127.0.0.1:PORT/rollouts/ID/v1``: any OpenAI client, ``/chat/completions`` and
``/completions``), the rollout ``ID``, the prompt as the data holds it and the row's other columns; it runs its
loop (calls, tools, a sandbox...) and returns its reward, None, or a dict of columns for the rewards.

The calls are sampled by the run's backend in batches: each batch is the next call of every episode still
running, taken once each has made it (or returned, or run out of time), so the batches' make-up does not
depend on timing; every call is sampled as the config says (the request's sampling fields are ignored: the
trainer's log-probabilities must be the sampler's) from its own key (the slot's key and the call's index), so
an episode is a function of the config and the agent's code. Each call is
recorded as the engine saw and sampled it: prompt ids, completion ids, log-probabilities.

The trajectory is built from those ids, never from re-tokenized text. A chat call whose messages are the
previous call's messages, its answer (as returned) and new messages continues the trajectory: the prompt the
engine sees is the trajectory so far plus the template's tokens for the new messages (out of the loss); any
other call starts a new branch, said in the records (``agent/branches``), and the episode trains on its last
branch. Budgets end a runaway: ``agent_max_calls`` calls, ``max_completion_length`` tokens after the first
prompt (sampled and added), ``agent_timeout`` seconds; past them a call is answered with an error and the
trajectory ends. An agent that raises leaves its reward None (unscored: out of its group), in one line.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from posttrain.data.prompts import ORIGIN_KEY, prompt_of
from posttrain.data.samples import render_ids
from posttrain.errors import UserError
from posttrain.generation.keyed import completion_key
from posttrain.generation.types import Completions, GenerationEngine, Sampling
from posttrain.logs import say

ROUTE = re.compile(r"^/rollouts/([0-9a-f]+)/v1/(chat/completions|completions|models)/?$")


class Refused(Exception):
    """A call the endpoint answers with an error (HTTP ``status``, OpenAI's error body)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Branch:
    """A trajectory: its first prompt as the engine saw it, then every token after it (``mask`` 1: sampled,
    0: added by the agent), the engine's log-probabilities (0 where added), the last call's messages."""

    prompt: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    truncated: bool = False
    messages: list[dict[str, Any]] | None = None  # the last chat call's, and its answer
    answer: str | None = None  # the last call's text

    def seen(self) -> list[int]:
        return self.prompt + self.ids

    def add(self, ids: list[int], sampled: bool, logps: list[float] | None = None) -> None:
        """Tokens after the prompt: sampled by the engine (in the loss, with its log-probabilities) or added
        by the agent (out of the loss, log-probability 0)."""
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logps += (logps or [0.0] * len(ids))[: len(ids)]


@dataclasses.dataclass
class Episode:
    """One slot's episode: its key, its deadline, its calls and branches, and why it ended."""

    key: int | None
    deadline: float
    branches: list[Branch] = dataclasses.field(default_factory=list)
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ended: str = ""  # a budget spent, or the agent's error
    returned: bool = False  # the agent's function has returned (or raised)
    pending: Request | None = None  # the call waiting for the engine

    def waited_for(self) -> bool:
        """Whether the next batch of calls waits for this episode (it runs, and has no call in yet)."""
        return not self.returned and not self.ended and self.pending is None


@dataclasses.dataclass
class Request:
    """A call waiting for the engine: what it asks, and (once served) its answer or why it was refused."""

    rollout: str
    kind: str
    branch: Branch
    new: bool
    prompt: list[int]
    tokens: int
    answer: dict[str, Any] | None = None
    refused: Refused | None = None


class Server(ThreadingHTTPServer):
    """The standard library's threading server with room for every episode's connection at once (its
    default backlog, 5, refuses connections when a batch's episodes call together)."""

    request_queue_size = 4096
    daemon_threads = True


class Endpoint:
    """The HTTP server (one per process, started on first use on 127.0.0.1) and the episodes it serves."""

    def __init__(self, tokenizer: Any, stops: set[int], limits: dict[str, Any]) -> None:
        self.tokenizer, self.stops, self.limits = tokenizer, stops, limits
        self.episodes: dict[str, Episode] = {}
        self.changed = threading.Condition()  # the episodes' state: calls in, answers out, agents done
        self.sampling: Sampling | None = None  # while a batch's episodes run
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(endpoint.models)

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    body = json.loads(self.rfile.read(length) or b"{}")
                except (ValueError, UnicodeDecodeError):  # no length, or not JSON
                    body = None
                self._answer(lambda rollout, kind: endpoint.call(rollout, kind, body))

            def _answer(self, work: Any) -> None:
                found = ROUTE.match(self.path)
                try:
                    if found is None:
                        raise Refused(f"no such route {self.path}: use the base_url given to the agent", 404)
                    status, out = 200, work(found.group(1), found.group(2))
                except Refused as exc:
                    status, out = (
                        exc.status,
                        {"error": {"message": str(exc), "type": "invalid_request_error"}},
                    )
                except (ValueError, TypeError, AttributeError, KeyError) as exc:  # a malformed request
                    message = f"the request could not be read: {type(exc).__name__}: {exc}"
                    status, out = 400, {"error": {"message": message, "type": "invalid_request_error"}}
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # quiet: the records say what happened
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="posttrain-agents", daemon=True)
        self.thread.start()

    def base_url(self, rollout: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/rollouts/{rollout}/v1"

    # ------------------------------------------------------------------------------------------ a call

    def models(self, rollout: str, kind: str) -> dict[str, Any]:
        """``GET /models``: the one model an episode's base URL serves (named by its rollout id)."""
        if kind != "models":
            raise Refused(f"GET {kind}: use POST", 405)
        return {"object": "list", "data": [{"id": rollout, "object": "model", "owned_by": "posttrain"}]}

    def call(self, rollout: str, kind: str, body: Any) -> dict[str, Any]:
        """An agent's call (an HTTP thread): checked, its prompt found, then waiting until :meth:`serve` has
        sampled it with the other episodes' calls."""
        if kind == "models":
            raise Refused("POST to /models: use GET", 405)
        if not isinstance(body, dict):
            raise Refused("the request's body is not a JSON object")
        if body.get("stream") or int(body.get("n") or 1) != 1:
            raise Refused("stream and n > 1 are not served: one answer per call")
        with self.changed:
            episode = self.episodes.get(rollout)
            if episode is None or self.sampling is None:
                raise Refused(f"no episode {rollout} is running", 404)
            try:
                self._budget(episode)
                branch, new = self._prompt(episode, kind, body)
                room = self.limits["tokens"] - len(branch.ids)
                if room <= 0:
                    episode.ended = (
                        f"max_completion_length: {self.limits['tokens']} tokens after the first prompt"
                    )
                    raise Refused(f"this episode's budget is spent ({episode.ended})")
            finally:
                self.changed.notify_all()  # an episode ended by its budget is waited for no more
            asked = (
                body.get("max_completion_tokens") or body.get("max_tokens") or self.sampling.max_new_tokens
            )
            tokens = max(1, min(int(asked), room))
            request = Request(rollout, kind, branch, new, branch.seen(), tokens)
            episode.pending = request
            self.changed.notify_all()
            self.changed.wait_for(lambda: request.answer is not None or request.refused is not None)
            if request.refused is not None:
                raise request.refused
            assert request.answer is not None
            return request.answer

    def serve(self, backend: GenerationEngine, module: Any, logprobs: bool) -> None:
        """Sample the episodes' calls until every episode has returned or ended (the generation thread): each
        batch is the next call of every episode still running, taken once each has one in (or its time is
        up), so its make-up does not depend on timing; one ``generate`` per requested length."""
        while True:
            with self.changed:
                self.changed.wait_for(self._ready, timeout=self._until_deadline())
                self._end_late()
                running = [e for e in self.episodes.values() if not e.returned and not e.ended]
                ready = [e.pending for e in self.episodes.values() if e.pending is not None and not e.ended]
                if not running and not ready:
                    return
                if any(e.waited_for() for e in running):
                    continue  # woken early (a time limit not yet up)
                batch = [r for r in ready if r is not None]
            for tokens in sorted({r.tokens for r in batch}):
                self._sample(backend, module, logprobs, [r for r in batch if r.tokens == tokens])

    def _ready(self) -> bool:
        return not any(e.waited_for() for e in self.episodes.values())

    def _until_deadline(self) -> float | None:
        deadlines = [e.deadline for e in self.episodes.values() if not e.returned and not e.ended]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _end_late(self) -> None:
        """Episodes past ``agent_timeout``: ended, a call of theirs refused."""
        for episode in self.episodes.values():
            if not episode.returned and not episode.ended and time.monotonic() > episode.deadline:
                episode.ended = f"agent_timeout: {self.limits['seconds']:g} s spent"
                if episode.pending is not None:
                    episode.pending.refused = Refused(f"this episode's budget is spent ({episode.ended})")
                    episode.pending = None
                self.changed.notify_all()

    def _budget(self, episode: Episode) -> None:
        if episode.ended:
            raise Refused(f"this episode has ended ({episode.ended})")
        if len(episode.calls) >= self.limits["calls"]:
            episode.ended = f"agent_max_calls: {self.limits['calls']} calls made"
        elif time.monotonic() > episode.deadline:
            episode.ended = f"agent_timeout: {self.limits['seconds']:g} s spent"
        if episode.ended:
            raise Refused(f"this episode's budget is spent ({episode.ended})")

    def _prompt(self, episode: Episode, kind: str, body: dict[str, Any]) -> tuple[Branch, bool]:
        """The branch this call extends (or a new one) with the prompt the engine is to see."""
        last = episode.branches[-1] if episode.branches else None
        if kind == "chat/completions":
            messages, tools = body.get("messages"), body.get("tools")
            if not isinstance(messages, list) or not messages:
                raise Refused("messages: a non-empty list of chat messages is needed")
            added = self._continuation(last, messages, tools) if last is not None else None
            if added is not None and last is not None:
                last.add(added, sampled=False)
                last.messages = messages
                return last, False
            branch = Branch(render_ids(self.tokenizer, messages, add_generation_prompt=True, tools=tools))
            branch.messages = messages
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = [int(t) for t in prompt]
            elif isinstance(prompt, str):
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                raise Refused("prompt: a string or a list of token ids is needed")
            if last is not None and ids[: len(last.seen())] == last.seen():
                last.add(ids[len(last.seen()) :], sampled=False)
                return last, False
            branch = Branch(list(ids))
        if len(branch.prompt) > self.limits["prompt"]:
            raise Refused(f"the prompt has {len(branch.prompt)} tokens, more than {self.limits['prompt']}")
        episode.branches.append(branch)
        return branch, True

    def _continuation(self, last: Branch, messages: list[dict[str, Any]], tools: Any) -> list[int] | None:
        """The template's tokens for what the agent added after the last answer, when ``messages`` are the last
        call's messages, that answer, then more; None: not a continuation (a new branch)."""
        before, answer = last.messages, last.answer
        if before is None or answer is None or len(messages) <= len(before) + 1:
            return None
        reply = messages[len(before)]
        if (
            messages[: len(before)] != before
            or reply.get("role") != "assistant"
            or reply.get("content") != answer
        ):
            return None
        prefix = render_ids(self.tokenizer, [*before, reply], tools=tools)
        full = render_ids(self.tokenizer, messages, add_generation_prompt=True, tools=tools)
        ends = [i for i, token in enumerate(prefix) if token in self.stops]
        if not ends or full[: ends[-1]] != prefix[: ends[-1]]:
            return None  # the template does not render the new messages after the answer: a new branch
        cut = ends[-1] + (0 if last.truncated else 1)  # an answer cut short gets the end of turn added
        return full[cut:]

    def _sample(self, backend: GenerationEngine, module: Any, logprobs: bool, batch: list[Request]) -> None:
        """One ``generate`` for calls asking the same length, each from its own key; their answers out."""
        assert self.sampling is not None
        episodes = [self.episodes[r.rollout] for r in batch]
        keys = [None if e.key is None else completion_key(e.key, len(e.calls)) for e in episodes]
        asking = dataclasses.replace(self.sampling, max_new_tokens=batch[0].tokens)
        prompts = [r.prompt for r in batch]
        out = backend.generate(module, prompts, asking, None if keys[0] is None else keys, logprobs)  # type: ignore[arg-type]
        with self.changed:
            for index, (request, episode) in enumerate(zip(batch, episodes, strict=True)):
                ids, cut = list(out.ids[index]), bool(out.truncated[index])
                logps = list(out.logps[index]) if out.logps is not None else None
                request.answer = self._answer(request, episode, ids, cut, logps)
                episode.pending = None
            self.changed.notify_all()

    def _answer(
        self, request: Request, episode: Episode, ids: list[int], cut: bool, logps: list[float] | None
    ) -> dict[str, Any]:
        """The sampled tokens into the episode's branch and calls; the OpenAI reply."""
        branch, prompt, call = request.branch, request.prompt, len(episode.calls)
        branch.add(ids, sampled=True, logps=logps)
        branch.truncated = cut
        text = self.tokenizer.decode([t for t in ids if t not in self.stops], skip_special_tokens=True)
        branch.answer = text
        episode.calls.append(
            {
                "branch": len(episode.branches) - 1,
                "new_branch": request.new,
                "prompt_ids": prompt,
                "completion_ids": ids,
                "logprobs": logps,
            }
        )
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        finish = "length" if cut else "stop"
        common = {"id": f"{request.rollout}-{call}", "created": int(time.time()), "model": request.rollout}
        common["usage"] = usage
        if request.kind == "chat/completions":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            return {**common, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish}
        return {**common, "object": "text_completion", "choices": [choice]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class AgentLoop:
    """The multi-turn rollouts of ``agent_function`` (see the module docstring): the episodes of a batch's
    slots, run on threads, served by one :class:`Endpoint`."""

    def __init__(self, config: Any, tokenizer: Any, stops: list[int]) -> None:
        from posttrain.config.user_code import import_named

        self.name = config.agent_function
        self.function = import_named(config.agent_function)
        self.tokenizer, self.stops = tokenizer, set(stops)
        data = config.data
        self.limits = {
            "calls": config.agent_max_calls,
            "seconds": config.agent_timeout,
            "tokens": config.max_completion_length,
            "prompt": getattr(data, "max_prompt_length", None) or data.max_length,
        }
        self.endpoint: Endpoint | None = None
        self.counts = {"episodes": 0.0, "calls": 0.0, "branched": 0.0, "budget": 0.0, "crashed": 0.0}
        self.crash_said = False

    def generate(
        self,
        backend: GenerationEngine,
        module: Any,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool = False,
        trainer_state: Any = None,
    ) -> Completions:
        """Each row's episode, its last branch as the completion (the agent writes its own prompts;
        ``prompt_ids``, as the data stage rendered them, stand for an episode that made no call)."""
        if self.endpoint is None:
            refuse_collective_generation(backend, module)
            self.endpoint = Endpoint(self.tokenizer, self.stops, self.limits)
        endpoint = self.endpoint
        names = [
            f"{k:016x}" if keys is not None else f"{id(rows):x}{i:04x}" for i, k in enumerate(keys or rows)
        ]
        started = time.monotonic()
        with endpoint.changed:
            endpoint.episodes = {
                name: Episode(None if keys is None else keys[i], started + self.limits["seconds"])
                for i, name in enumerate(names)
            }
            endpoint.sampling = sampling
        episodes = endpoint.episodes
        results: dict[str, Any] = {}
        for name, row in zip(names, rows, strict=True):
            threading.Thread(
                target=self._episode, args=(endpoint, name, row, results), daemon=True, name=f"agent-{name}"
            ).start()
        try:
            endpoint.serve(backend, module, logprobs)
        finally:
            with endpoint.changed:  # an agent still running past its time has its calls refused from now on
                endpoint.sampling = None
                for episode in episodes.values():
                    episode.ended = episode.ended or ("" if episode.returned else "agent_timeout")
        return self._completions(rows, prompt_ids, names, episodes, results)

    def _episode(self, endpoint: Endpoint, name: str, row: dict[str, Any], results: dict) -> None:
        episode = endpoint.episodes[name]  # (the batch's: a late agent outlives it)
        columns = {k: v for k, v in row.items() if k not in ("prompt", "messages", ORIGIN_KEY)}
        try:
            results[name] = self.function(
                base_url=endpoint.base_url(name), rollout_id=name, prompt=prompt_of(row), **columns
            )
        except Exception as exc:
            results[name] = exc
        finally:
            with endpoint.changed:
                episode.returned = True
                endpoint.changed.notify_all()

    def _completions(
        self,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        names: list[str],
        episodes: dict[str, Episode],
        results: dict,
    ) -> Completions:
        ids, truncated, logps, masks, prompts, messages, calls = [], [], [], [], [], [], []
        rewards: list[Any] = []
        extra: dict[str, list[Any]] = {}
        for index, (row, name) in enumerate(zip(rows, names, strict=True)):
            episode, result = episodes[name], results.get(name)
            if isinstance(result, Exception):
                self.counts["crashed"] += 1
                if not self.crash_said:
                    say(
                        f"agent_function {self.name} raised in episode {name} (prompt of "
                        f"{row.get(ORIGIN_KEY, 'a row')}): {type(result).__name__}: {result}; the episode is "
                        "unscored (its reward None) and the run goes on (said once)"
                    )
                    self.crash_said = True
                result = None
            branch = episode.branches[-1] if episode.branches else Branch(list(prompt_ids[index]))
            if not episode.branches:
                episode.ended = episode.ended or "the agent made no call"
            self.counts["episodes"] += 1
            self.counts["calls"] += len(episode.calls)
            self.counts["branched"] += len(episode.branches) > 1
            self.counts["budget"] += episode.ended.startswith(("agent_", "max_completion_length"))
            ids.append(branch.ids)
            truncated.append(branch.truncated or bool(episode.ended))
            logps.append(branch.logps)
            masks.append(branch.mask)
            prompts.append(branch.prompt)
            shown = list(branch.messages or [])
            if branch.answer is not None:
                shown.append({"role": "assistant", "content": branch.answer})
            messages.append(shown)
            calls.append(episode.calls)
            if isinstance(result, dict):
                for key, value in result.items():
                    extra.setdefault(key, [None] * len(rows))[index] = value
                rewards.append(result.get("agent_reward"))
            else:
                rewards.append(result)
        for column in extra.values():
            column += [None] * (len(rows) - len(column))
        columns = {"agent_reward": rewards, **{k: v for k, v in extra.items() if k != "agent_reward"}}
        return Completions(
            ids,
            truncated,
            logps,
            tool_mask=masks,
            prompt_ids=prompts,
            messages=messages,
            columns=columns,
            calls=calls,
        )

    def records(self) -> dict[str, float]:
        """This process's counts since the last call (the feed sums them over the processes)."""
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        return {f"agent/{name}": value for name, value in counts.items()}

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()


def refuse_collective_generation(backend: GenerationEngine, module: Any) -> None:
    """transformers' ``generate`` under ZeRO-3 gathers the weights for every call, a collective that episodes
    on several processes cannot keep in step: refused in one line."""
    import torch.distributed as torch_dist

    several = torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1
    if several and backend.name == "transformers" and any(hasattr(p, "ds_id") for p in module.parameters()):
        raise UserError(
            "agent_function with ZeRO-3 on several processes and transformers' generate: each call would gather "
            "the weights on every process in step, which independent episodes cannot do; use use_vllm: true, "
            "or ZeRO stage 0-2"
        )
