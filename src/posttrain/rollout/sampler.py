"""Where a batch's completions come from, for the step feed (``rollout/feed.py``): the sampling the config
asks for, the run's generation engine (``registry.GENERATION_ENGINES``: ``generation/``), multi-turn
rollouts (tools, environments, ``rollout_func``, ``agent_function``) and generation ahead of training
(``rollout/ahead.py``), which is the one source of a batch's completions when it is on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.context import RunContext
from posttrain.errors import UserError
from posttrain.generation.engine import EngineCopy
from posttrain.generation.transformers_engine import generation_eos
from posttrain.generation.types import Completions, EngineInputs, GenerationEngine, Sampling
from posttrain.models.sampling_policy import policy_of
from posttrain.rollout.ahead import Ahead, OnPolicy
from posttrain.tokenizers.chat_templates import end_of_turn_ids
from posttrain.tokenizers.padding import input_pad_id
from posttrain.vision.collate import prompt_images
from posttrain.vision.processor import processor_of


def sampling_of(config: Any, tokenizer: Any = None) -> Sampling:
    """The sampling an online method's config asks for (TRL's names: ``max_completion_length``,
    ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``min_p``), with the model's input-only
    tokens never drawn (``sampling_policy.policy_of``)."""
    policy = policy_of(config, tokenizer)
    return Sampling(
        config.max_completion_length,
        config.temperature,
        policy.top_p,
        policy.top_k,
        policy.repetition_penalty,
        policy.min_p,
        policy.banned,
    )


def stop_ids(tokenizer: Any, module: torch.nn.Module | None = None) -> list[int]:
    """Where a completion ends: the chat template's end-of-turn tokens, the tokenizer's EOS and (given the
    model) its generation config's EOS ids, as TRL stops."""
    found = end_of_turn_ids(tokenizer) | ({tokenizer.eos_token_id} - {None})
    return sorted(found | (generation_eos(module) if module is not None else set()))


def build_backend(
    config: Any,
    module: torch.nn.Module,
    stops: list[int],
    pad_id: int,
    data: Any,
    rows: int,
    dist: Any,
    stopping: Callable[[], bool] = lambda: False,
    processor: Any = None,
) -> GenerationEngine:
    """The run's generation engine, by its name in ``registry.GENERATION_ENGINES`` (``generation_engine``;
    by default transformers' ``generate`` on the training weights, or with ``use_vllm`` vLLM in this process
    or the run's server). ``processor``: a vision-language model's (the prompts hold images)."""
    from posttrain.registry import GENERATION_ENGINES

    inputs = EngineInputs(module, stops, pad_id, data, rows, dist, stopping, processor)
    engine: GenerationEngine = GENERATION_ENGINES.get(config.engine_name).obj(config, inputs)
    return engine


class RolloutSampler:
    """The run's sampling, engine and multi-turn rollouts for this rank (``rows``: its completions of a
    batch), and generation ahead once :meth:`start_ahead` turned it on."""

    def __init__(
        self, ctx: RunContext, module: torch.nn.Module, tokenizer: Any, data: Any, rows: int
    ) -> None:
        config = ctx.config
        self.sampling = sampling_of(config, tokenizer)
        self.pad_id = input_pad_id(tokenizer, config.tokenizer.missing_pad_token_strategy)
        self.stops = stop_ids(tokenizer, module)
        self.processor = processor_of(tokenizer)  # a vision-language model's: prompts with images
        stopping = ctx.stopping.is_set
        self.backend = build_backend(
            config, module, self.stops, self.pad_id, data, rows, ctx.dist, stopping, self.processor
        )
        from posttrain.rollout.agent import multi_turn

        self.turns = multi_turn(config, tokenizer, self.stops)  # multi-turn rollouts: tools, rollout_func
        self.source: Ahead | OnPolicy = OnPolicy()  # the batches' source: generated when due, or ahead

    def start_ahead(
        self,
        config: Any,
        module: torch.nn.Module,
        generate: Callable[[int, Any], Completions],
        total: int,
        world: int,
    ) -> None:
        """Generation ahead of training (``max_staleness``, ``weight_sync_steps``): batch k's completions for
        this rank from ``generate(k, backend)``, ``total`` batches in all."""
        backend = self.backend
        if not isinstance(backend, EngineCopy):
            raise UserError(
                f"max_staleness / weight_sync_steps generate ahead of training from an engine's own copy of the "
                f"weights; the {backend.name} engine generates on the training weights: use vLLM "
                "(use_vllm: true) or set max_staleness: 0"
            )
        self.source = Ahead(
            generate,
            backend,
            lambda: backend.push(module),
            config.max_staleness,
            config.weight_sync_steps,
            total,
            world,
            background=config.vllm_mode == "server",  # an engine in this process generates when asked
        )

    def complete(
        self,
        module: torch.nn.Module,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool = False,
        backend: GenerationEngine | None = None,
        trainer_state: Any = None,
    ) -> Completions:
        """Completions of the rows' prompts: multi-turn (tools, environments, a ``rollout_func``:
        ``rollout.agent``), or one turn each; ``keys`` None: greedy (evaluation). ``backend`` None: the run's,
        from the current weights (an evaluation first waits for the batches in flight); ``trainer_state``:
        what user functions see of the run."""
        if backend is None:
            backend = self.backend
            self.source.other_weights()  # the engine is given the current weights
        pictures = prompt_images(rows)
        if self.turns is not None:
            if any(pictures):
                raise UserError(
                    "prompts with images in a multi-turn run (tools, environments, rollout_func): not supported yet"
                )
            return self.turns.generate(
                backend,
                module,
                rows,
                prompt_ids,
                sampling,
                keys,
                logprobs,
                trainer_state=trainer_state,
            )
        return backend.generate(module, prompt_ids, sampling, keys, logprobs, pictures)

    def close(self) -> None:
        self.source.close()
        self.backend.close()
        if self.turns is not None:
            self.turns.close()
