"""Resuming a ``deepspeed`` checkpoint on another number of processes: N -> M, the same run step for step.

What a checkpoint's layout depends on is recorded with it (``layout_of``): processes, ZeRO stage, global
batch, sequence- and expert-parallel degrees. On another process count:

- ZeRO 1, 2 and 3: the optimizer state is sharded over the data-parallel ranks, so rank 0 converts the
  checkpoint once into DeepSpeed's universal format (``deepspeed.checkpoint.ds_to_universal``: one file per
  parameter and state, whatever the world size), kept beside it as ``<tag>/universal``, and every rank loads
  its new shards from it (DeepSpeed's ``load_universal``).
- ZeRO 0: the state is whole in every process; it loads as it is.
- One process runs ZeRO 1/2 as stage 0 (``config.deepspeed.single_process_stage``). Resuming across that
  line keeps the checkpoint's stage (``resume_stage``): a ZeRO-2 checkpoint resumes on one process at ZeRO 2,
  a one-process (stage 0) checkpoint on two processes at stage 0; the log says so.
- The global batch must stay the same for the same run (``total_train_batch_size`` derives the accumulation
  for any process count). When it cannot, the run stops and says what would change, unless the checkpoint's
  ``accept_batch_change`` lets it continue from the same sample of the epoch with the new batch.
- Sequence- and expert-parallel degrees are kept; another degree is refused with the reason.

The data position is the samples consumed in the epoch, which the sampler gives the same for any process
count at a fixed global batch (a global permutation read in order, ``data/sampler.py``). RNG streams: the
data order depends on the seed and epoch only; each process takes its own saved RNG state when the
checkpoint has one for its rank (dropout masks after a resize differ: they depend on which rank draws them).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from posttrain.checkpoint.layout import latest_marker
from posttrain.config.checkpoint import DeepSpeedCheckpointConfig
from posttrain.config.deepspeed import uses_bf16_optimizer
from posttrain.errors import UserError

UNIVERSAL = "universal"


def resume_stage(config: Any, world_size: int, built: dict[str, Any]) -> str:
    """Keep the stage of the checkpoint the run will resume when the process count changed and only the
    single-process stage 0 stands between them (``built`` is changed in place). The note for the log."""
    resumable = [
        c
        for c in config.checkpoint
        if isinstance(c, DeepSpeedCheckpointConfig) and c.enabled and c.auto_resume
    ]
    found = latest_marker(Path(resumable[0].output_dir)) if resumable else None
    if found is None:
        return ""
    path, record = found
    saved, now = saved_stage(path, record), built["zero_optimization"]["stage"]
    if record.get("world_size") == world_size and saved == 0 and now == 1 and uses_bf16_optimizer(built):
        return _keep_unfused_bf16(path, built)
    if saved is None or record.get("world_size") == world_size or saved == now or 3 in (saved, now):
        return ""
    if 0 not in (saved, now):
        return ""  # ZeRO 1 <-> 2: the universal checkpoint carries over
    built["zero_optimization"]["stage"] = saved
    why = (
        "the universal checkpoint carries its optimizer state over"
        if saved
        else "its optimizer state is whole, in every process"
    )
    return (
        f"resuming {path.name}, written at ZeRO stage {saved} by {record['world_size']} process(es), on "
        f"{world_size}: this run uses stage {saved} too ({why})"
    )


def saved_stage(path: Path, record: dict[str, Any]) -> int | None:
    """The ZeRO stage a checkpoint was written at: recorded since checkpoints record their layout; before
    that, stage 0 when no optimizer shard file is there (its state is whole, in the model file)."""
    if "zero_stage" in record:
        return int(record["zero_stage"])
    return None if any(path.glob("*optim_states.pt")) else 0


def _keep_unfused_bf16(path: Path, built: dict[str, Any]) -> str:
    """A one-process bfloat16 checkpoint from before posttrain ran DeepSpeed's BF16_Optimizer there: its
    optimizer state (bfloat16, whole) is in the model file, not in BF16_Optimizer's shard, so the run goes
    on as it was trained: stage 0, bfloat16 gradient accumulation (``built`` is changed in place)."""
    built["zero_optimization"]["stage"] = 0
    types = {k: v for k, v in built.get("data_types", {}).items() if k != "grad_accum_dtype"}
    if types:
        built["data_types"] = types
    else:
        built.pop("data_types", None)
    return (
        f"resuming {path.name}, written by one bfloat16 process at ZeRO stage 0 (posttrain before it ran "
        "DeepSpeed's BF16_Optimizer there; the optimizer state is in bfloat16 in the model file): this run "
        "goes on as it was trained, at stage 0 with bfloat16 gradient accumulation; a new run gets "
        "BF16_Optimizer's float32 master weights and accumulation"
    )


def reshard_notes(saved: dict[str, Any], now: dict[str, int], accept_batch_change: bool) -> list[str]:
    """Refuse what cannot resume on ``now``; what changes, for the log."""
    where = f"written by {saved['world_size']} process(es), resumed on {now['world_size']}"
    for key, what in (
        ("sequence_parallel_size", "sequence-parallel"),
        ("expert_parallel_size", "expert-parallel"),
    ):
        if saved.get(key, 1) != now[key]:
            raise UserError(
                f"the checkpoint ({where}) has {key}={saved.get(key, 1)}, this run {now[key]}: resharding to "
                f"another {what} degree is not supported; resume with {key}={saved.get(key, 1)}, or start a new "
                "run from the huggingface export"
            )
        if now[key] > 1:
            raise UserError(
                f"the checkpoint ({where}) uses {key}={now[key]}: {what} checkpoints resume on the same number of "
                "processes only; resume there, or start a new run from the huggingface export"
            )
    stages = {saved["zero_stage"], now["zero_stage"]}
    if len(stages) > 1 and stages & {0, 3}:  # ZeRO 1 <-> 2 share DeepSpeed's universal loader
        raise UserError(
            f"the checkpoint ({where}) was written at ZeRO stage {saved['zero_stage']}, this run uses stage "
            f"{now['zero_stage']}: set deepspeed.zero_optimization.stage: {saved['zero_stage']} to resume it"
        )
    notes = [f"the checkpoint was {where}: ZeRO {saved['zero_stage']} -> {now['zero_stage']}"]
    if saved["global_batch"] != now["global_batch"]:
        change = (
            f"the global batch would change from {saved['global_batch']} to {now['global_batch']} samples per "
            "step, so the steps after the checkpoint would not be the run's"
        )
        if not accept_batch_change:
            raise UserError(
                f"{change}. Keep it with total_train_batch_size: {saved['global_batch']} (micro-batches and "
                "accumulation are derived for any process count), or set the deepspeed checkpoint's "
                "accept_batch_change: true to continue from the same sample with the new batch"
            )
        notes.append(f"{change}: accepted (accept_batch_change); the data continues from the same sample")
    return notes


def universal_copy(path: Path, dist: Any) -> Path:
    """``path/universal``: rank 0 converts the ZeRO checkpoint at ``path`` once (atomically); all ranks wait."""
    from posttrain.dist import barrier

    target = path / UNIVERSAL
    if dist.is_main and not (target / "zero").is_dir():
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        staging = path / f".{UNIVERSAL}-tmp"
        shutil.rmtree(staging, ignore_errors=True)
        ds_to_universal(
            argparse.Namespace(
                input_folder=str(path),
                output_folder=str(staging),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,  # DeepSpeed's own state for clients other than Megatron
            )
        )
        (path / "latest_universal").unlink(missing_ok=True)  # DeepSpeed's pointer; the tag is given instead
        os.replace(staging, target)
    barrier(dist)
    return target


def load_resharded(engine: Any, path: Path, saved: dict[str, Any], dist: Any) -> None:
    """Load the checkpoint at ``path`` into an engine on another process count."""
    if saved["zero_stage"] == 0:
        if not engine.load_state(str(path.parent), path.name):
            raise UserError(f"DeepSpeed could not load the checkpoint {path}")
        return
    universal_copy(path, dist)
    config = engine.ds._config  # DeepSpeed reads its load_universal setting when loading
    config.load_universal_checkpoint = True
    try:
        if not engine.load_state(str(path), UNIVERSAL):
            raise UserError(f"DeepSpeed could not load the universal checkpoint {path / UNIVERSAL}")
    finally:
        config.load_universal_checkpoint = False


def epoch_step_after(saved: dict[str, Any], now: dict[str, int], epoch_step: int) -> int:
    """The position in the epoch in steps of the new global batch (the same sample when it is unchanged)."""
    if saved["global_batch"] == now["global_batch"]:
        return epoch_step
    return epoch_step * saved["global_batch"] // now["global_batch"]
