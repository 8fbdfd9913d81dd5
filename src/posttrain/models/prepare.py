"""The model stage of a run: a model factory loads the model and reports its facts; this module checks the
config against those facts, builds the DeepSpeed config (once, from the facts), and applies every transform
the run asks for, in one ordered function, to whatever the factory loaded.

The order of :func:`prepare_model` matters: checkpointing is switched on before adapters wrap the model;
embeddings grow after the adapters exist (so the warning about untrained new rows is right); the MLP and
attention kernels are swapped on the final modules; expert and sequence parallelism shard and route last
before compiling, which captures the blocks as they will run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.checkpoint.reshard import resume_stage
from posttrain.config import moe as moe_checks
from posttrain.config import sequence_parallel as sp_checks
from posttrain.config.deepspeed import build_deepspeed_config, single_process_stage
from posttrain.config.model import ModelConfig
from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.dataplan import max_length_for
from posttrain.errors import UserError
from posttrain.extras import StepExtra
from posttrain.logs import get_logger, say
from posttrain.memory.check import check_before_loading
from posttrain.models.compile import compile_blocks
from posttrain.models.document_attention import REPLACED, use_document_attention
from posttrain.models.expert_parallel import install_expert_parallel
from posttrain.models.facts import ModelFacts, facts_from_model
from posttrain.models.memory import apply_activation_checkpointing, tile_mlps
from posttrain.models.moe import routing_recorder
from posttrain.models.peft import apply_peft
from posttrain.models.sequence_parallel import install_sequence_parallel
from posttrain.models.token_logps import unwrap
from posttrain.registry import MODEL_FACTORIES


@dataclass
class LoadedModel:
    model: torch.nn.Module
    facts: ModelFacts
    deepspeed: dict[str, Any]  # the DeepSpeed config, built from the facts
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
    return LoadedModel(prepare_model(model, config, facts, tokenizer), facts, ds_config, zero3)


def prepare_model(
    model: torch.nn.Module, config: TrainerConfig, facts: ModelFacts, tokenizer: Any
) -> torch.nn.Module:
    """Every transform of the run, in order, on a loaded model (see the module docstring)."""
    model_config = config.model
    apply_activation_checkpointing(
        model, not model_config.disable_activation_checkpoint, config.activation_checkpoint_cpu_offload
    )
    model = apply_peft(model, model_config.peft_config, model_config.peft_pretrained)
    _fit_embeddings(model, tokenizer)
    if config.tiled_mlp_compute:
        tile_mlps(model)
    documents = config.data.padding_free or config.data.pack_samples
    if documents and model_config.attn_implementation in REPLACED and config.sequence_parallel_size == 1:
        kept = use_document_attention(model)  # rows of several documents: no mask over the row
        if kept:
            say(f"per-document attention does not apply to this model ({kept}): packed rows use a masked row")
    moe = facts.moe
    if moe is not None and moe_checks.wants_grouped(config.arctic_moe, config.expert_parallel_size, moe):
        layout = install_expert_parallel(unwrap(model), config.expert_parallel_size, moe.num_experts)
        say(
            f"MoE layers run grouped: {moe.num_experts} experts per layer, {layout.local} on each of "
            f"{layout.size} expert-parallel processes"
        )
    if config.sequence_parallel_size > 1:
        install_sequence_parallel(
            unwrap(model),
            config.sequence_parallel_size,
            model_config.attn_implementation,
            config.micro_batch_size,
        )
    if model_config.compile:
        compile_blocks(model)
    return model


def load_reference_model(config: ModelConfig, ctx: RunContext) -> torch.nn.Module:
    """A frozen model to compare against (DPO's reference): loaded by its factory, with the saved adapter of
    ``peft_pretrained`` when it names one; no training transform applies."""
    model = MODEL_FACTORIES.get(config.type or "huggingface").obj(config, ctx)
    if config.peft_pretrained:
        model = apply_peft(model, None, config.peft_pretrained)
    return model.eval().requires_grad_(False)


def check_model(config: TrainerConfig, facts: ModelFacts, world_size: int) -> None:
    """The checks that need the model's facts, each feature's from its own module."""
    sp_checks.check_model(config.sequence_parallel_size, facts, config.model.attn_implementation)
    moe_checks.check_model(config, facts, world_size)


def step_extras(module: torch.nn.Module, facts: ModelFacts, config: TrainerConfig) -> list[StepExtra]:
    """What the model adds to each training step (a mixture of experts: its router loss and expert load)."""
    routing = routing_recorder(unwrap(module), facts.moe, config.model.router_aux_loss_coef)
    return [routing] if routing is not None else []


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


def _fit_embeddings(model: torch.nn.Module, tokenizer: Any) -> None:
    """Grow the model's token embeddings when the tokenizer gained tokens (chat-template presets)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(embeddings, "num_embeddings", None)
    if size is None or len(tokenizer) <= size:
        return
    model.resize_token_embeddings(len(tokenizer))
    say(f"token embeddings resized from {size} to {len(tokenizer)} for the added special tokens")
    if getattr(model, "peft_config", None):
        get_logger().warning(
            "the added tokens' embeddings are not trained by the adapter; add embed_tokens and lm_head to "
            "peft_config modules_to_save to train them"
        )


def _resolve_auto_dtype(config: TrainerConfig, found: str | None) -> None:
    """``model.dtype: auto`` becomes the checkpoint's dtype (float32 when it names none), so that DeepSpeed's
    mixed precision and the throughput meter follow it."""
    if config.model.dtype != "auto":
        return
    name = (found or "float32").removeprefix("torch.")
    config.model.dtype = name if name in ("float32", "bfloat16", "float16") else "float32"
    say(f"model.dtype auto: {config.model.dtype} (the checkpoint's)")
