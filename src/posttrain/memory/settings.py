"""The memory plan's inputs, read from a resolved config: the DeepSpeed config the run will build (ZeRO stage,
offload, buckets), the memory features, the batch and the method's rows per sample (and the ``config.json``
of any reward model the method scores with)."""

from __future__ import annotations

from posttrain.config.deepspeed import build_deepspeed_config, uses_bf16_optimizer
from posttrain.config.deepspeed_block import offload_device
from posttrain.config.trainer import TrainerConfig
from posttrain.memory.estimate import Settings
from posttrain.memory.shape import ModelShape, causal_lm_shape, scorer_shape
from posttrain.registry import TRAINERS, load_component


def settings_for(
    config: TrainerConfig,
    shape: ModelShape,
    world_size: int,
    tokens_per_row: int,
    device: str,
    image_tokens: int = 0,
) -> Settings:
    """``config`` resolved for ``world_size`` processes (batch sizes filled in), rows of at most
    ``tokens_per_row`` tokens (of them at most ``image_tokens`` image tokens), training on ``device``
    (``cuda`` or ``cpu``)."""
    ds = build_deepspeed_config(config, world_size=world_size, hidden_size=shape.hidden)
    zero = ds["zero_optimization"]
    dtype = shape.dtype if config.model.dtype == "auto" else config.model.dtype
    quantisation = config.model.quantization_config or {}
    sp = config.sequence_parallel_size
    spec = TRAINERS.get(config.type).obj
    rows = spec.rows_per_sample
    method = load_component(spec.memory)(config) if spec.memory else {}
    # a rank generates its share of its replica's completions (sequence parallelism: split over the group)
    generation_rows = config.micro_batch_size * config.gradient_accumulation_steps // sp
    if method.get("tokens_per_row_extra"):  # training rows are prompt + completion
        tokens_per_row = tokens_per_row + method["tokens_per_row_extra"]
    return Settings(
        dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
        world_size=world_size,
        stage=int(zero["stage"]),
        offload_optimizer=offload_device(ds, "optimizer"),
        offload_param=offload_device(ds, "param"),
        optimizer=config.optimizer.type or "adamw",
        reduce_bucket=_count(zero.get("reduce_bucket_size")),
        prefetch_bucket=_count(zero.get("stage3_prefetch_bucket_size")),
        max_live_parameters=_count(zero.get("stage3_max_live_parameters")),
        checkpointing=not config.model.disable_activation_checkpoint,
        checkpoint_offload=config.activation_checkpoint_cpu_offload,
        tiled_mlp=config.tiled_mlp_compute,
        tiled_loss=config.tiled_loss_compute,
        sequence_parallel=sp,
        expert_parallel=config.expert_parallel_size,
        micro_batch=config.micro_batch_size,
        gradient_accumulation=config.gradient_accumulation_steps,
        tokens_per_row=tokens_per_row,
        rows_per_sample=rows,
        eager_attention=config.model.attn_implementation == "eager",
        documents=config.joins_documents,
        four_bit=bool(quantisation.get("load_in_4bit")),
        device=device,
        bf16_optimizer=uses_bf16_optimizer(ds),
        generation_rows=generation_rows if method.get("generation_rows") else 0,
        generation_tokens=tokens_per_row,
        image_tokens=image_tokens,
        reference_model=bool(method.get("reference_model")) and config.model.peft_config is None,
        vllm_share=float(method.get("vllm_share", 0.0)),
        reward_models=tuple(
            (scorer.name, scorer.params, scorer.dtype)
            for scorer in (scorer_shape(key, path) for key, path in method.get("reward_models", ()))
        ),
        teacher_models=tuple(
            (shape.name, shape.params, shape.dtype)
            for shape in (
                causal_lm_shape(key, path, dtype) for key, path, dtype in method.get("teacher_models", ())
            )
        ),
    )


def _count(value: object) -> int:
    """A bucket size as DeepSpeed reads it (a number, possibly written 5e8); 0 for ``auto`` or none."""
    try:
        return int(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0
