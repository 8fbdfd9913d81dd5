"""Settings that only apply in some modes, in one table.

A key written in the file (or an override) whose mode is off has no effect: ``profiling.profile_step_start``
without the profiler, ``label_smoothing`` with the ipo loss, ``lora_plus_scale`` without adapters. Such keys are
reported as warnings, all of them the same way, by every command that validates (``validate``, ``train``,
``preprocess``, ``plot-lr``): never silently ignored, never an error (a run can keep its W&B project while W&B is
turned off). Only keys the user wrote are reported; defaults never are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True)
class ModeKeys:
    """``keys`` of the section at ``owner`` take effect only when ``applies(config)``; ``needs`` says when."""

    owner: str
    keys: tuple[str, ...]
    applies: Callable[[Any], bool]
    needs: str


def _peft(config: Any) -> bool:
    return config.model.peft_config is not None or config.model.peft_pretrained is not None


def _decay(style: str) -> Callable[[Any], bool]:
    return lambda config: getattr(config.scheduler, "lr_decay_style", None) == style


MODE_KEYS: tuple[ModeKeys, ...] = (
    ModeKeys("", ("manual_gc_interval", "manual_gc_eval"), lambda c: c.manual_gc, "manual_gc: true"),
    ModeKeys(
        "",
        ("max_per_device_train_batch_size",),
        lambda c: c.total_train_batch_size is not None,
        "total_train_batch_size",
    ),
    ModeKeys(
        "",
        ("eval_iters", "eval_log_iter_interval"),
        lambda c: c.data.has_eval,
        "eval data (data.eval_sources or data.train_eval_split)",
    ),
    ModeKeys(
        "",
        ("mem_profiler_dir", "mem_profiler_max_entries"),
        lambda c: c.mem_profiler is not None,
        "mem_profiler: step or e2e",
    ),
    ModeKeys(
        "", ("label_smoothing",), lambda c: getattr(c, "loss_type", None) == "sigmoid", "loss_type: sigmoid"
    ),
    ModeKeys("", ("simpo_gamma",), lambda c: getattr(c, "loss_type", None) == "simpo", "loss_type: simpo"),
    ModeKeys(
        "",
        ("reference_free",),
        lambda c: getattr(c, "loss_type", None) in ("sigmoid", "ipo", "hinge"),
        "a loss with a reference model (sigmoid, ipo, hinge)",
    ),
    ModeKeys(
        "optimizer", ("lora_plus_scale",), _peft, "LoRA adapters (model.peft_config or model.peft_pretrained)"
    ),
    ModeKeys(
        "optimizer",
        ("lr_reference_batch_size",),
        lambda c: c.optimizer.lr_batch_size_scaling != "none",
        "optimizer.lr_batch_size_scaling: sqrt or linear",
    ),
    ModeKeys(
        "scheduler",
        ("lr_wsd_decay_style", "lr_wsd_decay_iters"),
        _decay("WSD"),
        "scheduler.lr_decay_style: WSD",
    ),
    ModeKeys("scheduler", ("power", "lr_end"), _decay("polynomial"), "scheduler.lr_decay_style: polynomial"),
    ModeKeys(
        "scheduler",
        ("start_weight_decay", "end_weight_decay"),
        lambda c: getattr(c.scheduler, "weight_decay_incr_style", "constant") != "constant",
        "scheduler.weight_decay_incr_style: linear or cosine",
    ),
    ModeKeys(
        "scheduler",
        ("lr_warmup_init",),
        lambda c: bool(
            getattr(c.scheduler, "lr_warmup_iters", 0) or getattr(c.scheduler, "lr_warmup_fraction", None)
        ),
        "a warmup (scheduler.lr_warmup_iters or lr_warmup_fraction)",
    ),
    ModeKeys(
        "profiling",
        ("profile_step_start", "profile_step_end", "profile_ranks", "record_shapes"),
        lambda c: c.profiling.use_pytorch_profiler,
        "profiling.use_pytorch_profiler: true",
    ),
    ModeKeys(
        "tensorboard",
        ("log_dir", "log_throughput", "log_memory", "log_timers", "log_params_norm"),
        lambda c: c.tensorboard.enable,
        "tensorboard.enable: true",
    ),
    ModeKeys("wandb", ("entity", "project", "name", "mode"), lambda c: c.wandb.enable, "wandb.enable: true"),
    ModeKeys("data", ("mix_seed",), lambda c: c.data.mix == "weighted", "data.mix: weighted"),
    ModeKeys(
        "data",
        ("split_seed",),
        lambda c: c.data.train_eval_split[1] > 0,
        "a held-out split (data.train_eval_split)",
    ),
    ModeKeys("data", ("packing",), lambda c: c.data.pack_samples, "data.pack_samples: true"),
)


def _section(config: Any, owner: str) -> BaseModel | None:
    target = config
    for part in owner.split(".") if owner else []:
        target = getattr(target, part, None)
    return target if isinstance(target, BaseModel) else None


def inert_settings(config: Any) -> Iterator[tuple[str, str]]:
    """(key path, what it needs) for every written key whose mode is off."""
    derived = getattr(config, "_derived", set())  # filled in from other values, not written
    for entry in MODE_KEYS:
        section = _section(config, entry.owner)
        if section is None:
            continue
        owner = tuple(entry.owner.split(".")) if entry.owner else ()
        written = [
            key
            for key in entry.keys
            if key in type(section).model_fields
            and key in section.model_fields_set
            and (*owner, key) not in derived
        ]
        if written and not entry.applies(config):
            for key in written:
                yield (f"{entry.owner}.{key}" if entry.owner else key), entry.needs
    for index, source in enumerate(getattr(config.data, "sources", [])):
        if (
            "sample_seed" in source.model_fields_set
            and source.sample_ratio is None
            and source.sample_count is None
        ):
            yield f"data.sources[{index}].sample_seed", "data.sources[].sample_ratio or sample_count"
    for index, engine in enumerate(config.checkpoint):
        if (
            "save_merged" in type(engine).model_fields
            and "save_merged" in engine.model_fields_set
            and not _peft(config)
        ):
            yield f"checkpoint[{index}].save_merged", "LoRA adapters to merge (model.peft_config)"


def inert_warnings(config: Any) -> list[str]:
    return [f"{path} has no effect: it is used only with {needs}" for path, needs in inert_settings(config)]
