"""Build the DeepSpeed config dict from a ``TrainerConfig`` (pure: the caller supplies model facts)."""

from __future__ import annotations

import copy
from typing import Any

from posttrain.config.deepspeed_block import offload_device
from posttrain.config.trainer import TrainerConfig

#: the smallest gradient-reduction bucket (elements): hidden^2 alone makes hundreds of tiny collectives for a
#: small model (136 per step for 8.9M parameters at hidden 256; with gloo, two processes then took 1.15x a
#: DDP loop's step, 0.87x of that with one large bucket); from hidden 4096 on, hidden^2 is larger anyway
MIN_REDUCE_BUCKET = 2**24


def zero_defaults(hidden_size: int, world_size: int, offload: bool = False) -> dict[str, Any]:
    """ZeRO defaults recommended by the DeepSpeed team, scaled by the model's hidden size.

    Stage 2 as in ArcticTraining when there are several processes. A single process has nothing to partition, and
    stage 2's bucketed gradient reduction then only costs time (about 9% of a step on the benchmark model),
    so it gets stage 0 unless the optimizer is offloaded (which needs stage 1 or more); a stage 1 or 2 the
    user sets runs as stage 0 there too, and in bfloat16 stage 1 with float32 gradient accumulation
    (``single_process_stage``).
    """
    return {
        "stage": 2 if world_size > 1 or offload else 0,
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_live_parameters": 2 * hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "reduce_bucket_size": max(hidden_size * hidden_size, MIN_REDUCE_BUCKET),
    }


def single_process_stage(requested: Any, built: dict[str, Any]) -> str:
    """The note a run prints when one process runs another ZeRO stage than the one asked for.

    With one process a ZeRO 1/2 "partition" is the whole optimizer state, so sharding saves nothing; DeepSpeed
    would still copy every gradient into reduction buckets and all-reduce them over a group of one (about 9%
    of a step on the benchmark model). In float32, stage 0 gives the same updates without those copies. In
    bfloat16, stage 0 would take DeepSpeed's unfused optimizer (a host read per parameter tensor each step,
    gradients accumulated in bfloat16), so one process runs stage 1 with float32 gradient accumulation:
    DeepSpeed's ``BF16_Optimizer`` (float32 master weights and gradients in flat buffers, one optimizer step
    over them). Stage 3 and any offload keep their stage (they change where tensors live). Empty when nothing
    was changed."""
    stage = built["zero_optimization"]["stage"]
    if _bf16(built) and stage == 1 and requested != 1 and requested != 3:
        asked = f"stage {requested}" if requested is not None else "the default stage"
        if uses_bf16_optimizer(built):
            return (
                f"bfloat16 with one process: {asked} runs as DeepSpeed's BF16_Optimizer (ZeRO stage 1 over one "
                "process: float32 master weights and gradient accumulation, one optimizer step over flat "
                "buffers)"
            )
        return (
            f"bfloat16 with one process: {asked} runs as ZeRO stage 1 over one process, with float32 master "
            f"weights and gradients accumulated in {accumulation_dtype(built)} "
            "(deepspeed.data_types.grad_accum_dtype; fp32 would run DeepSpeed's BF16_Optimizer)"
        )
    if requested in (1, 2) and stage == 0:
        return (
            f"deepspeed.zero_optimization.stage {requested} with one process shards nothing; it runs as stage 0 "
            "(same updates, no gradient bucket copies); with several processes it shards as asked"
        )
    return ""


def _bf16(ds: dict[str, Any]) -> bool:
    return bool(ds.get("bf16", ds.get("bfloat16", {})).get("enabled"))


def accumulation_dtype(ds: dict[str, Any]) -> str:
    """The dtype DeepSpeed accumulates gradients in: ``data_types.grad_accum_dtype`` when set, else the
    model's (16-bit weights accumulate in 16 bits)."""
    written = str(ds.get("data_types", {}).get("grad_accum_dtype", "") or "").lower().removeprefix("torch.")
    names = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    if written:
        return names.get(written, written)
    return "bfloat16" if _bf16(ds) else "float16" if ds.get("fp16", {}).get("enabled") else "float32"


def uses_bf16_optimizer(ds: dict[str, Any]) -> bool:
    """Whether DeepSpeed will wrap the optimizer in its ``BF16_Optimizer``: bfloat16, ZeRO stage 1 without
    offload, float32 gradient accumulation (DeepSpeed's own rule)."""
    zero = ds["zero_optimization"]
    return (
        _bf16(ds)
        and zero["stage"] == 1
        and offload_device(ds, "optimizer") == "none"
        and accumulation_dtype(ds) == "float32"
    )


def build_deepspeed_config(config: TrainerConfig, *, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The user's ``deepspeed:`` block with every missing key filled in.

    Keys the user set win; a partial ``zero_optimization`` block is merged key by key with the defaults
    instead of replacing them. Batch sizes always follow ``micro_batch_size`` and
    ``gradient_accumulation_steps`` (validation refuses a disagreeing value).
    """
    ds = copy.deepcopy(config.deepspeed)
    ds["train_micro_batch_size_per_gpu"] = config.micro_batch_size
    ds["gradient_accumulation_steps"] = config.gradient_accumulation_steps
    # DeepSpeed is given no sequence-parallel unit: it reduces gradients over every process as data
    # parallelism (models/sequence_parallel.py says why), so its batch counts every process too.
    ds["train_batch_size"] = config.micro_batch_size * config.gradient_accumulation_steps * world_size
    ds.setdefault("steps_per_print", 10**9)  # posttrain prints its own metrics
    offload = offload_device(ds, "optimizer") != "none"
    zero = {**zero_defaults(hidden_size, world_size, offload), **ds.get("zero_optimization", {})}
    if offload_device(ds, "param") != "none" and "stage" not in ds.get("zero_optimization", {}):
        zero["stage"] = 3
    dtype = config.model.dtype
    for key, wanted in (("bf16", "bfloat16"), ("fp16", "float16")):
        block = ds.get("bfloat16" if key == "bf16" and "bfloat16" in ds else key)
        if block is None:
            ds[key] = {"enabled": dtype == wanted}
        elif block.get("enabled") == "auto":
            block["enabled"] = dtype == wanted
    if world_size == 1 and zero["stage"] in (0, 1, 2) and not offload:  # see single_process_stage
        zero["stage"] = 1 if _bf16(ds) else 0
        if _bf16(ds):
            ds["data_types"] = {"grad_accum_dtype": "fp32", **ds.get("data_types", {})}
    ds["zero_optimization"] = zero
    ds.setdefault("gradient_clipping", 1.0)
    ds.setdefault("prescale_gradients", False)
    ds.setdefault("wall_clock_breakdown", False)
    # posttrain passes a torch optimizer to DeepSpeed; ZeRO accepts it with this flag.
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    return ds
