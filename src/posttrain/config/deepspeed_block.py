"""Checks of the ``deepspeed:`` block, with DeepSpeed's own config models where DeepSpeed has them.

DeepSpeed itself ignores unknown top-level keys and validates sub-blocks only when the engine starts. Here every
key is checked at validation, with its path: unknown top-level keys against the keys DeepSpeed reads, and the
``zero_optimization``, ``bf16``, ``fp16``, monitor and ``comms_logger`` blocks with DeepSpeed's pydantic models
(imported only when the block is not empty). Keys that posttrain sets from other settings are refused when they
disagree with them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ValidationError

from posttrain.config.base import Problem, allowed_keys, did_you_mean, field_names, model_at
from posttrain.utils.imports import import_deepspeed

#: top-level keys DeepSpeed reads (its config reference); blocks with a model are checked further below
TOP_LEVEL_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "sparse_gradients",
        "gradient_clipping",
        "fp16",
        "bf16",
        "bfloat16",
        "torch_autocast",
        "amp",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "activation_checkpointing",
        "aio",
        "flops_profiler",
        "comms_logger",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "memory_breakdown",
        "disable_allgather",
        "dataloader_drop_last",
        "checkpoint",
        "data_types",
        "data_efficiency",
        "curriculum_learning",
        "compression_training",
        "elasticity",
        "autotuning",
        "nebula",
        "pipeline",
        "pld",
        "eigenvalue",
        "sparse_attention",
        "compile",
        "hybrid_engine",
        "timers",
        "use_node_local_storage",
        "load_universal",
        "use_data_before_expert_parallelism",
        "graph_harvesting",
        "zenflow",
        "tensor_parallel",
        "disable_python_gc",
        "log_level",
        "vocabulary_size",
        "weight_quantization",
        "quantize_training",
    }
)

#: keys posttrain derives from its own settings: "auto" or the same value is fine, another value is refused
_DERIVED = {
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
}


def _models() -> dict[str, type[BaseModel]]:
    import_deepspeed()
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "bfloat16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
        "comet": CometConfig,
        "comms_logger": CommsLoggerConfig,
    }


def _model_problems(key: str, cls: type[BaseModel], value: Any) -> Iterator[Problem]:
    if not isinstance(value, dict):
        yield Problem(f"deepspeed.{key}", f"{value!r}: expected a mapping of keys")
        return
    # "auto" for `enabled` is filled from model.dtype (bf16/fp16) when the DeepSpeed config is built
    value = {k: v for k, v in value.items() if not (k == "enabled" and v == "auto")}
    try:
        cls.model_validate(value)
    except ValidationError as exc:
        for error in exc.errors():
            path = ".".join(str(part) for part in ("deepspeed", key, *error["loc"]))
            if error["type"] == "extra_forbidden":
                owner = model_at(cls, tuple(error["loc"][:-1]))
                allowed = sorted(field_names(owner, deprecated=False)) if owner else []
                hint = did_you_mean(str(error["loc"][-1]), allowed)
                yield Problem(
                    path, f"unknown DeepSpeed key{hint} {allowed_keys(str(error['loc'][-1]), allowed)}"
                )
            else:
                message = error["msg"].removeprefix("Value error, ")
                yield Problem(path, f"{error.get('input')!r}: {message} (DeepSpeed's {cls.__name__})")


def zero_block(block: dict[str, Any]) -> dict[str, Any]:
    value = block.get("zero_optimization", {})
    return value if isinstance(value, dict) else {}


def offload_device(block: dict[str, Any], what: str) -> str:
    """``cpu``/``nvme`` when ``zero_optimization.offload_<what>`` moves it off the accelerator, else ``none``."""
    value = zero_block(block).get(f"offload_{what}")
    if not isinstance(value, dict):
        return "none"
    return str(value.get("device", "none"))


def deepspeed_problems(block: dict[str, Any], settings: dict[str, Any]) -> Iterator[Problem]:
    """Problems of the ``deepspeed:`` block. ``settings`` holds the posttrain values the block must agree with
    (``micro_batch_size``, ``gradient_accumulation_steps``, ``optimizer``: the optimizer type)."""
    yield from _offload_problems(block, settings["optimizer"])
    if not block:
        return
    for key in block:
        if key not in TOP_LEVEL_KEYS:
            yield Problem(
                f"deepspeed.{key}",
                f"unknown DeepSpeed key{did_you_mean(str(key), TOP_LEVEL_KEYS)} (see DeepSpeed's config reference)",
            )
    if block.get("train_batch_size") not in (None, "auto"):
        yield Problem(
            "deepspeed.train_batch_size",
            "is derived from micro_batch_size x gradient_accumulation_steps x processes; set those "
            "(or total_train_batch_size) instead",
        )
    for key, ours in _DERIVED.items():
        if block.get(key) not in (None, "auto", settings[ours]):
            yield Problem(f"deepspeed.{key}", f"{block[key]!r}: set {ours} instead (it is {settings[ours]})")
    for key, where in (("optimizer", "optimizer:"), ("scheduler", "scheduler:")):
        if key in block:
            yield Problem(
                f"deepspeed.{key}",
                f"posttrain builds the {key} from the top-level {where} section (types and settings there); "
                "move these settings to it",
            )
    models = _models()
    for key, value in block.items():
        if key in models:
            yield from _model_problems(key, models[key], value)


def _offload_problems(block: dict[str, Any], optimizer: str) -> Iterator[Problem]:
    device = offload_device(block, "optimizer")
    stage = zero_block(block).get("stage")
    if device != "none" and stage == 0:
        yield Problem(
            "deepspeed.zero_optimization.stage",
            f"0 cannot offload the optimizer (offload_optimizer.device: {device}); use stage 1, 2 or 3",
        )
    if offload_device(block, "param") != "none" and stage not in (None, 3):
        yield Problem(
            "deepspeed.zero_optimization.stage",
            f"{stage}: offload_param needs stage 3 (only stage 3 partitions the parameters)",
        )
    if optimizer == "cpu_adam" and device != "cpu":
        yield Problem(
            "optimizer.type",
            "cpu_adam steps on the host for ZeRO optimizer offload: set "
            "deepspeed.zero_optimization.offload_optimizer.device: cpu, or use adamw",
        )
    if optimizer == "fused_adam" and device != "none":
        yield Problem(
            "optimizer.type",
            f"fused_adam steps on the accelerator, but the optimizer is offloaded to {device}: use cpu_adam",
        )
