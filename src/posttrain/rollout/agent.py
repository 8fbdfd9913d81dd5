"""Multi-turn rollouts: the model calls tools, reads their results and goes on (TRL's ``tools`` and
``environment_factory``), or a hand-written rollout (``rollout_func``). Both generation engines, every online
method: the feed asks ``Agent.generate`` where it would ask the generation engine.

A rollout: each prompt is rendered with its tools' schemas by the model's chat template (an environment's
``reset(**row)`` observation appended to the last user message first); the model generates a turn; the tool
calls in it (read in the model's format, ``tools.parse_calls``) run (``tools.ToolRunner``: rollouts in
parallel, ``tool_timeout``); their results are appended as tool messages through the chat template (the
template's own tokens between an assistant turn and the next, found from a two-turn conversation as TRL
does), and the model goes on, until a turn calls no tool, ``max_tool_calling_iterations`` turns have called
tools, or the completion (tool tokens included) reaches ``max_completion_length``: a tool result that would
pass it is dropped and the rollout ends, as in TRL.

The model's tokens are kept as generated (never decoded and re-encoded); the tools' tokens have mask 0
(``Completions.tool_mask``): no loss, no log-probability, no ratio on them. Turn t of a completion draws from
its key mixed with t (turn 0 from the key itself, so a rollout without tool calls is the single-turn one).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Protocol

from posttrain.config.agents import (
    accepts,
    environment_class,
    environment_factory_of,
    environment_tools,
    signature,
    where_defined,
)
from posttrain.data.prompts import ORIGIN_KEY, prompt_of, row_tools
from posttrain.data.prompts import prompt_ids as rendered_prompt
from posttrain.data.samples import keep_prompt_tokens, render_ids
from posttrain.errors import UserError
from posttrain.generation.keyed import completion_key
from posttrain.generation.types import Completions, GenerationEngine, Sampling
from posttrain.logs import say
from posttrain.rewards.calls import user_frame
from posttrain.rollout.tools import ToolCall, ToolRunner, load_tool, parse_calls, tool_format

_HERMES_BLOCK = "<tool_call>"


class Agent:
    """An online run's multi-turn rollouts (see the module docstring). Built from the run's config and
    tokenizer; ``stops``: the ids a turn ends at."""

    def __init__(self, config: Any, tokenizer: Any, stops: list[int]) -> None:
        self.config, self.tokenizer, self.stops = config, tokenizer, set(stops)
        self.limit = config.max_completion_length
        iterations = config.max_tool_calling_iterations
        self.iterations = sys.maxsize if iterations is None else iterations
        weaker = bool(getattr(config, "sandbox_accept_weaker", False))
        self.functions = {f.__name__: f for f in (load_tool(entry, weaker) for entry in config.tools)}
        factory = config.environment_factory
        self.multi = isinstance(factory, dict)
        entries = factory if isinstance(factory, dict) else {None: factory} if factory else {}
        self.factories = {k: Environments(v) for k, v in entries.items()}
        self.form = tool_format(tokenizer, config.tool_call_format)
        self.runner = ToolRunner(config.tool_timeout)
        self.said: set[str] = set()  # the tools whose error has been said
        for cls in dict.fromkeys(e.cls for e in self.factories.values()):
            if not environment_tools(cls):
                given = f"only the tools {', '.join(self.functions)}" if self.functions else "no tool"
                say(
                    f"environment {cls.__name__} ({where_defined(cls)}) has no tools (no public method besides "
                    f"reset and get_reward): the model is given {given} in its rollouts"
                )

    # ------------------------------------------------------------------------------------- the prompts

    def environment_of(self, row: dict[str, Any]) -> Any:
        """A fresh instance of the row's environment (None without ``environment_factory``); the data stage
        refused rows naming no known environment."""
        if not self.factories:
            return None
        return self.factories[row["environment"] if self.multi else None].build(row)

    def tables(self, environment: Any) -> dict[str, Callable[..., Any]]:
        """The rollout's tools by name: the functions, then its environment's methods bound to it."""
        table = dict(self.functions)
        if environment is not None:
            table.update({name: getattr(environment, name) for name in environment_tools(type(environment))})
        return table

    def prompt(self, row: dict[str, Any], environment: Any, rendered: list[int]) -> list[int]:
        """The rollout's prompt: as the data stage rendered it with the tools' schemas (``rendered``), or, when
        the environment's ``reset(**row)`` returns an observation, rendered again with the observation appended
        to the last user message (as TRL)."""
        if environment is None:
            return rendered
        arguments = {
            k: v for k, v in row.items() if k != ORIGIN_KEY and not (self.multi and k == "environment")
        }
        observation = reset(environment, arguments, str(row.get(ORIGIN_KEY, "a row")))
        if observation is None:
            return rendered
        messages = [dict(m) for m in prompt_of(row)]
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
        data = self.config.data
        ids = rendered_prompt(self.tokenizer, messages, row_tools(row, data.tool_schemas))
        return keep_prompt_tokens(ids, data.max_prompt_length, data.prompt_truncation)

    def suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """The template's tokens after an assistant turn that called tools: the tool messages and the next
        assistant header (TRL's two-turn conversation, cut after the assistant turn's end-of-turn token)."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [
            {"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ]
        prefix = render_ids(self.tokenizer, dummy)
        full = render_ids(self.tokenizer, dummy + tool_messages, add_generation_prompt=True)
        ends = [i for i, token in enumerate(prefix) if token in self.stops]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise UserError(
                "the chat template does not render a tool result after an assistant turn as a continuation of it "
                "(the two-turn conversation's tokens are not a prefix of the three-turn one); tools need a "
                "template that renders user -> assistant with tool_calls -> tool"
            )
        return full[len(prefix) :]

    # ------------------------------------------------------------------------------------------ a rollout

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
        """Multi-turn completions of the rows (one per row; ``prompt_ids``: their prompts as the data stage
        rendered them, tools included); ``keys`` None: greedy (evaluation). Each turn samples the rollouts
        still going, then runs the tools their turns called; a rollout ends when its turn calls none."""
        environments = [self.environment_of(row) for row in rows]
        paths = [
            Trajectory(
                self.prompt(row, env, ids),
                row_tools(row, self.config.data.tool_schemas) or [],
                self.tables(env),
            )
            for row, env, ids in zip(rows, environments, prompt_ids, strict=True)
        ]
        active, turn = list(range(len(rows))), 0
        while active:
            calling = self._turn(backend, module, paths, active, sampling, keys, turn, logprobs)
            active = self._answer(paths, calling)
            turn += 1
        return Completions(
            [t.ids for t in paths],
            [t.truncated for t in paths],
            [t.logps for t in paths] if logprobs else None,
            tool_mask=[t.mask for t in paths],
            prompt_ids=[t.prompt for t in paths],
            messages=[t.messages for t in paths],
            environments=environments if self.factories else None,
            tool_calls=sum(t.calls for t in paths),
            tool_failures=sum(t.failures for t in paths),
        )

    def _turn(
        self,
        backend: GenerationEngine,
        module: Any,
        paths: list[Trajectory],
        active: list[int],
        sampling: Sampling,
        keys: list[int] | None,
        turn: int,
        logprobs: bool,
    ) -> dict[int, list[ToolCall]]:
        """One turn of the active rollouts (turn t drawn from the completion's key mixed with t, each within
        what is left of its ``max_completion_length``); the tool calls of those that go on, by rollout."""
        budget = [self.limit - len(paths[i].ids) for i in active]
        out = backend.generate(
            module,
            [paths[i].prompt + paths[i].ids for i in active],
            dataclasses.replace(sampling, max_new_tokens=max(budget)),
            None if keys is None else [completion_key(keys[i], turn) if turn else keys[i] for i in active],
            logprobs,
        )
        calling = {}
        for j, i in enumerate(active):
            path, new = paths[i], out.ids[j][: budget[j]]
            prefix = path.prompt + path.ids
            text = self._text(new)
            found = parse_calls(self.tokenizer, self.form, text, new, prefix, path.schemas)
            cut = out.truncated[j] or len(out.ids[j]) > budget[j]
            path.add_turn(new, None if out.logps is None else out.logps[j], self._assistant(text, found), cut)
            if found and not cut and turn < self.iterations:
                calling[i] = found
        return calling

    def _answer(self, paths: list[Trajectory], calling: dict[int, list[ToolCall]]) -> list[int]:
        """Run the calls (the rollouts in parallel) and append their results as tool messages through the
        chat template; the rollouts with room left for the results and an answer go on (as in TRL)."""
        if not calling:
            return []
        results = self.runner.run(list(calling.values()), [paths[i].table for i in calling])
        for name, line in self.runner.raised.items():
            if name not in self.said:
                self.said.add(name)
                say(f"{line}; the model reads the error as the tool's answer (as in TRL)")
        going = []
        for i, answers in zip(calling, results, strict=True):
            tool_messages = [{"role": "tool", "name": name, "content": text} for name, text, _ in answers]
            if paths[i].add_tools(tool_messages, self.suffix_ids(tool_messages), answers, self.limit):
                going.append(i)
        return going

    def _text(self, ids: list[int]) -> str:
        """A turn's text, its closing end-of-turn token left out (special tokens kept: some formats' tool
        calls are special tokens)."""
        kept = ids[:-1] if ids and ids[-1] in self.stops else ids
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def _assistant(self, text: str, calls: list[ToolCall]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            if self.form == "hermes" and _HERMES_BLOCK in text:
                message["content"] = text[: text.index(_HERMES_BLOCK)].rstrip()
            message["tool_calls"] = [call.as_message() for call in calls]
        return message

    def records(self) -> dict[str, float]:
        """Counts of its own for the step's records: none (the tools' are ``Completions.tool_calls``)."""
        return {}

    def close(self) -> None:
        self.runner.close()


@dataclasses.dataclass
class Trajectory:
    """One rollout as it grows: its prompt (as the model saw it), the tools it may call (their schemas, and
    its table of callables), and turn by turn its tokens, whose they are (``mask``: 1 the model's, 0 the
    tools'), the engine's log-probabilities, the messages, and the tool calls made and failed."""

    prompt: list[int]
    schemas: list[dict[str, Any]]
    table: dict[str, Callable[..., Any]]
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    truncated: bool = False
    calls: int = 0
    failures: int = 0

    def add_turn(self, new: list[int], logps: Any, message: dict[str, Any], cut: bool) -> None:
        """The model's turn: its tokens (in the loss), their log-probabilities when the engine gave them."""
        self.ids += new
        self.mask += [1] * len(new)
        if logps is not None:
            self.logps += list(logps[: len(new)])
        self.messages.append(message)
        self.truncated = cut

    def add_tools(
        self,
        messages: list[dict[str, Any]],
        suffix: list[int],
        answers: list[tuple[str, str, bool]],
        limit: int,
    ) -> bool:
        """The tools' answers (``suffix``: their tokens and the next assistant header, out of the loss);
        False, and nothing added, when they would leave no room for an answer within ``limit`` tokens."""
        self.calls += len(answers)
        self.failures += sum(failed for _, _, failed in answers)
        if len(self.ids) + len(suffix) >= limit:
            return False
        self.messages += messages
        self.ids += suffix
        self.mask += [0] * len(suffix)
        self.logps += [0.0] * len(suffix)
        return True


class Environments:
    """One ``environment_factory`` entry: builds a row's environment, its errors one line naming the user's
    factory and line."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.factory = environment_factory_of(entry)
        self.cls = environment_class(entry)

    def build(self, row: dict[str, Any]) -> Any:
        try:
            environment = self.factory()
        except Exception as exc:
            raise UserError(
                f"environment_factory {self.entry} raised {type(exc).__name__}: {exc}{_at(exc)} building the "
                f"environment of {row.get(ORIGIN_KEY, 'a row')}"
            ) from None
        if type(environment) is not self.cls:
            raise UserError(
                f"environment_factory {self.entry} returned a {type(environment).__name__}, not the "
                f"{self.cls.__name__} it declares (its tools are read from {self.cls.__name__}); return one, or "
                "declare what it returns"
            )
        return environment


def reset(environment: Any, arguments: dict[str, Any], origin: str) -> Any:
    """``environment.reset(**arguments)``; a row it cannot take, or an error in it, one line naming the class,
    its line and the row."""
    cls = type(environment).__name__
    method = environment.reset
    try:
        return method(**arguments)
    except Exception as exc:
        if not accepts(method, **arguments):
            raise UserError(
                f"{cls}.reset{signature(method)} ({where_defined(method)}) cannot take the columns of {origin} "
                f"({', '.join(arguments)}); add **row to its parameters for the columns it does not read"
            ) from None
        raise UserError(
            f"{cls}.reset ({where_defined(method)}) raised {type(exc).__name__}: {exc}{_at(exc)} for {origin}"
        ) from None


def _at(exc: BaseException) -> str:
    frame = user_frame(exc)
    return f" at {frame}" if frame else ""


class HandWritten:
    """TRL's ``rollout_func``: ``function(prompts, trainer)``, one prompt (as the row holds it) per completion,
    returning ``prompt_ids``, ``completion_ids`` and ``logprobs`` (None when it has none), optionally
    ``env_mask`` (1 for the model's tokens; the rest is left out of the loss) and more columns, handed to the
    reward functions. ``trainer`` is a :class:`RolloutTrainer`."""

    def __init__(self, config: Any, tokenizer: Any, stops: list[int]) -> None:
        from posttrain.config.user_code import import_named

        self.function = import_named(config.rollout_func)
        self.name = config.rollout_func
        self.tokenizer, self.stops, self.limit = tokenizer, set(stops), config.max_completion_length

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
        """The function's rollout of the rows' prompts (as the rows hold them: it renders them itself)."""
        trainer = RolloutTrainer(backend, module, sampling, keys, logprobs, self.tokenizer, trainer_state)
        out = self.function([prompt_of(row) for row in rows], trainer)  # type: ignore[operator]
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(out if isinstance(out, dict) else {})
        if missing:
            raise UserError(
                f"rollout_func {self.name} returned {'no dict' if not isinstance(out, dict) else 'no ' + ', '.join(sorted(missing))}; "
                "return {'prompt_ids': [...], 'completion_ids': [...], 'logprobs': [...] or None}, one entry per prompt"
            )
        extra = {
            k: list(v)
            for k, v in out.items()
            if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")
        }
        ids = [list(map(int, c))[: self.limit] for c in out["completion_ids"]]
        for name, column in {"prompt_ids": out["prompt_ids"], "completion_ids": ids, **extra}.items():
            if len(column) != len(rows):
                raise UserError(
                    f"rollout_func {self.name} returned {len(column)} {name} for {len(rows)} prompts; one per prompt"
                )
        mask = out.get("env_mask")
        given = out["logprobs"]
        return Completions(
            ids,
            [
                not c or c[-1] not in self.stops for c in ids
            ],  # TRL: truncated when it does not end at a stop id
            [list(map(float, lp))[: len(c)] for lp, c in zip(given, ids, strict=True)]
            if given is not None
            else None,
            tool_mask=[list(map(int, m))[: len(c)] for m, c in zip(mask, ids, strict=True)]
            if mask is not None
            else None,
            prompt_ids=[list(map(int, p)) for p in out["prompt_ids"]],
            columns=extra or None,
        )

    def records(self) -> dict[str, float]:
        """Counts of its own for the step's records: none."""
        return {}

    def close(self) -> None:
        pass


class RolloutTrainer:
    """What a ``rollout_func`` gets as ``trainer``: the run's engine (``generate``), its ``tokenizer`` and
    ``trainer_state``, the batch's ``sampling``."""

    def __init__(
        self,
        backend: GenerationEngine,
        module: Any,
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool,
        tokenizer: Any,
        state: Any,
    ) -> None:
        self.backend, self.module, self.sampling, self.keys = backend, module, sampling, keys
        self.logprobs, self.tokenizer, self.trainer_state = logprobs, tokenizer, state
        self.calls = 0

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | None = None) -> dict[str, Any]:
        """Completions of ``prompt_ids`` (one per prompt, in the batch's order) with the run's engine and
        sampling, drawn from the batch's completion keys mixed with the call's number (so a second call draws
        afresh, and a resumed run the same): ``{"completion_ids", "logprobs", "truncated"}``."""
        keys = self.keys
        if keys is not None:
            if len(prompt_ids) != len(keys):
                keys = [completion_key(keys[i % len(keys)], i // len(keys)) for i in range(len(prompt_ids))]
            keys = [completion_key(k, self.calls) if self.calls else k for k in keys]
        sampling = (
            self.sampling
            if max_new_tokens is None
            else dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens)
        )
        self.calls += 1
        out = self.backend.generate(self.module, prompt_ids, sampling, keys, self.logprobs)
        return {"completion_ids": out.ids, "logprobs": out.logps, "truncated": out.truncated}


class MultiTurn(Protocol):
    """What the feed asks of a run's multi-turn rollouts (``Agent``, ``HandWritten``,
    ``agent_endpoint.AgentLoop``): one completion per row (its own prompt ids, a mask of the model's tokens),
    the counts of its own for the step's records, and its close."""

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
    ) -> Completions: ...

    def records(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def multi_turn(config: Any, tokenizer: Any, stops: list[int]) -> MultiTurn | None:
    """The run's multi-turn rollouts: an ``Agent`` (tools, environments), a ``rollout_func``, an agent that
    owns its loop (``agent_function``: ``rollout.agent_endpoint``), or None (the generation engine's single-turn
    completions). A run that executes model-written code first checks the sandbox."""
    if getattr(config, "runs_model_code", False):
        from posttrain.sandbox.confine import prepare

        prepare(config.sandbox_accept_weaker)
    if getattr(config, "rollout_func", None):
        return HandWritten(config, tokenizer, stops)
    if getattr(config, "agent_function", None):
        from posttrain.rollout.agent_endpoint import AgentLoop

        return AgentLoop(config, tokenizer, stops)
    if getattr(config, "agentic", False):
        return Agent(config, tokenizer, stops)
    return None


def agent_report(flight: Any) -> list[str]:
    """distill's ``report`` hook (``registry.ReportHook``), and part of grpo's: the pre-flight report's lines
    for a run that executes model-written code (what the sandbox holds here) and for a run with tools (the
    tools, the limits, the call format, and the first training prompt as the model sees it)."""
    config = flight.config
    lines = []
    if getattr(config, "runs_model_code", False):
        from posttrain.sandbox.confine import confinement

        found = confinement()
        lines.append(f"sandbox: {found.line()}")
        if found.missing:
            verdict = "runs with what holds" if config.sandbox_accept_weaker else "STOPS before training"
            lines.append(
                f"  (sandbox_accept_weaker: {str(config.sandbox_accept_weaker).lower()}: the run {verdict})"
            )
    if not getattr(config, "agentic", False):
        return lines
    import numpy as np

    from posttrain.rollout.tools import tool_format

    names = [str(s["function"]["name"]) for schemas in config.data.tool_schemas.values() for s in schemas]
    turns = config.max_tool_calling_iterations
    lines.insert(
        0,
        f"tools: {', '.join(dict.fromkeys(names))}; {'no limit on' if turns is None else f'at most {turns}'} "
        f"tool-calling turns, tool_timeout {config.tool_timeout:g} s; calls read as "
        f"{tool_format(flight.tokenizer, config.tool_call_format)}",
    )
    if len(flight.data.train):
        ids = np.asarray(flight.data.train[0]["input_ids"]).tolist()
        text = flight.tokenizer.decode(ids, skip_special_tokens=False)
        lines.append(f"the first training prompt as the model sees it ({len(ids)} tokens, with its tools):")
        lines += ["  | " + line for line in text.splitlines()]
    return lines
