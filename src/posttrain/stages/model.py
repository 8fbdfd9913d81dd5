"""The model stage of a run: a model factory loads the model and reports its facts; this module checks the
config against those facts, builds the DeepSpeed config (once, from the facts), and applies every transform
the run asks for to whatever the factory loaded, in the order of the ``MODEL_TRANSFORMS`` table
(``posttrain.builtins``).

The order matters: checkpointing is switched on before adapters wrap the model; embeddings grow after the
adapters exist (so the warning about untrained new rows is right); the MLP and attention kernels are swapped
on the final modules; expert and sequence parallelism shard and route last before compiling, which captures
the blocks as they will run. Each step lives with its feature (``models/``); this module only runs them, and
hands the engine what the features ask of it (:func:`engine_features`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.checkpoint.reshard import resume_stage
from posttrain.config import moe as moe_checks
from posttrain.config import sequence_parallel as sp_checks
from posttrain.config.deepspeed import build_deepspeed_config, single_process_stage
from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.errors import UserError
from posttrain.logs import say
from posttrain.memory.check import check_before_loading
from posttrain.models.compile import compiled_block_classes
from posttrain.models.expert_parallel import ExpertWeights, installed_layout, is_expert_parameter
from posttrain.models.facts import ModelFacts, facts_from_model
from posttrain.registry import MODEL_FACTORIES, MODEL_TRANSFORMS, STEP_EXTRAS
from posttrain.stages.data import max_length_for
from posttrain.training.engine import EngineFeatures
from posttrain.training.extras import StepExtra


@dataclass
class LoadedModel:
    model: torch.nn.Module
    facts: ModelFacts
    deepspeed: dict[str, Any]  # the DeepSpeed config, built from the facts
    features: EngineFeatures  # what the prepared model's features ask of the engine
    zero3: Any = None  # ZeRO-3's registration with transformers: drop it once the engine exists


def load_model(ctx: RunContext, tokenizer: Any) -> LoadedModel:
    """Load the configured model and prepare it. When the factory reports the facts before loading (from the
    checkpoint's config), the config is checked and, under ZeRO-3, the model is created partitioned before
    any weight is read; otherwise the facts come from the loaded model."""
    config = ctx.config
    factory = MODEL_FACTORIES.get(config.model.type).obj
    facts = factory.facts(config.model)
    model, zero3 = None, None
    if facts is None:  # only the loaded model can tell
        model = factory(config.model, ctx)
        facts = _facts_of(model)
    check_model(config, facts, ctx.dist.world_size)
    _resolve_auto_dtype(config, facts.dtype)
    ds_config = deepspeed_config(config, facts, ctx.dist.world_size)
    if model is None:
        check_before_loading(ctx, max_length_for(config, facts, announce=False))
        zero3 = zero3_registration(ds_config)
        model = factory(config.model, ctx)
    _resolve_auto_dtype(config, str(next(model.parameters()).dtype))
    facts = facts_from_model(model, facts) or facts  # the MLP shape, known once built
    model = prepare_model(model, config, facts, tokenizer)
    return LoadedModel(model, facts, ds_config, engine_features(model), zero3)


def prepare_model(
    model: torch.nn.Module, config: TrainerConfig, facts: ModelFacts, tokenizer: Any
) -> torch.nn.Module:
    """Every transform of the run, in the order of ``MODEL_TRANSFORMS`` (see the module docstring)."""
    for _, step in MODEL_TRANSFORMS.parts():
        model = step(model, config, facts, tokenizer)
    return model


def engine_features(model: torch.nn.Module) -> EngineFeatures:
    """What the prepared model's features ask of the engine: compiled blocks as ZeRO-3 leaves; the experts'
    process group and per-rank weights under expert parallelism."""
    layout = installed_layout(model)
    return EngineFeatures(
        zero3_leaves=tuple(compiled_block_classes(model)),
        local_group=layout.group if layout is not None else None,
        is_local=is_expert_parameter if layout is not None else None,
        rank_state=ExpertWeights() if layout is not None else None,
    )


def check_model(config: TrainerConfig, facts: ModelFacts, world_size: int) -> None:
    """The checks that need the model's facts, each feature's from its own module, then the method's."""
    sp_checks.check_model(config.sequence_parallel_size, facts, config.model.attn_implementation)
    moe_checks.check_model(config, facts, world_size)
    config.refuse_model_problems(facts)


def step_extras(module: torch.nn.Module, facts: ModelFacts, config: TrainerConfig) -> list[StepExtra]:
    """What the model's features add to each training step, in the order of ``STEP_EXTRAS`` (a mixture of
    experts: its router loss and expert load)."""
    extras = (build(module, facts, config) for _, build in STEP_EXTRAS.parts())
    return [extra for extra in extras if extra is not None]


def deepspeed_config(config: TrainerConfig, facts: ModelFacts, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of the run (ZeRO bucket sizes scale with the hidden size)."""
    if facts.hidden_size is None:
        raise UserError(
            "cannot read the model's hidden size (config.hidden_size) to fill the DeepSpeed config"
        )
    built = build_deepspeed_config(config, world_size=world_size, hidden_size=facts.hidden_size)
    note = single_process_stage(config.deepspeed.get("zero_optimization", {}).get("stage"), built)
    line = (
        resume_stage(config, world_size, built) or note
    )  # a checkpoint of another process count keeps its stage
    if line:
        say(line)
    return built


def zero3_registration(ds_config: dict[str, Any]) -> Any:
    """Under ZeRO-3, register the DeepSpeed config with transformers so ``from_pretrained`` creates the
    model already partitioned (``deepspeed.zero.Init``). Keep the returned object until the engine exists:
    transformers reads the registration again when DeepSpeed wraps the model. None: not ZeRO-3."""
    if ds_config["zero_optimization"].get("stage") != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def _facts_of(model: torch.nn.Module) -> ModelFacts:
    facts = facts_from_model(model)
    if facts is None:
        raise UserError(
            f"the model factory built a {type(model).__name__} with no transformers config, so the run cannot "
            "read its hidden size and heads; return a transformers PreTrainedModel"
        )
    return facts


def _resolve_auto_dtype(config: TrainerConfig, found: str | None) -> None:
    """``model.dtype: auto`` becomes the checkpoint's dtype (float32 when it names none), so that DeepSpeed's
    mixed precision and the throughput meter follow it."""
    if config.model.dtype != "auto":
        return
    name = (found or "float32").removeprefix("torch.")
    config.model.dtype = name if name in ("float32", "bfloat16", "float16") else "float32"
    say(f"model.dtype auto: {config.model.dtype} (the checkpoint's)")
