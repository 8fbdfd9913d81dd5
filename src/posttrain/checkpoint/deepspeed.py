"""Checkpoint engine ``deepspeed``: the full training state, resumable exactly.

Layout under ``output_dir``::

    global_step_40/            one complete checkpoint (DeepSpeed's model + optimizer shards, scheduler)
        posttrain_state.json   step, epoch, position in the epoch; written last: the completion marker
        rng_state_rank0.pt     every rank's Python, NumPy and torch RNG states
        loop_rank0.pt          a step feed's per-rank state, when it keeps one (grpo mid-batch)
    latest                     the newest complete tag (for DeepSpeed's own tools)
    .staging/                  checkpoints being written; never read

Every rank writes its shards into ``.staging/<tag>``; after a barrier rank 0 writes the marker and renames the
directory into place in one step. A process killed while saving leaves only a staging directory, which
``auto_resume`` never looks at, so the previous checkpoint stays the one that is resumed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.checkpoint.base import CheckpointEngine
from posttrain.checkpoint.layout import MARKER, complete_checkpoints, layout_of, loop_file, rng_file
from posttrain.checkpoint.reshard import epoch_step_after, load_resharded, reshard_notes
from posttrain.config.checkpoint import DeepSpeedCheckpointConfig
from posttrain.dist import barrier
from posttrain.errors import UserError
from posttrain.logs import say
from posttrain.utils.fs import atomic_write_text


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class DeepSpeedCheckpointEngine(CheckpointEngine):
    saves_on_early_stop = True
    config: DeepSpeedCheckpointConfig

    def save(self, engine: Any, state: Any, *, end: bool = False) -> Path:
        tag = f"global_step_{state.step}"
        target = self.output_dir / tag
        if state.step == self.last_saved_step:
            return target
        staging = self.output_dir / ".staging"
        dist = self.ctx.dist
        if dist.is_main:
            shutil.rmtree(staging / tag, ignore_errors=True)  # left by a run killed while saving
            staging.mkdir(parents=True, exist_ok=True)
        barrier(dist)
        engine.save_state(str(staging), tag)
        if state.rank_state:  # a step feed's own (grpo: the generated batch its next updates train on)
            torch.save(state.rank_state, staging / tag / loop_file(dist.rank))
        # after the rank state: saving it waits for the generations in flight, whose code may draw from the
        # process's generators (rollout/ahead.py): the generators are saved as the resumed run will find them
        torch.save(rng_state(), staging / tag / f"rng_state_rank{dist.rank}.pt")
        barrier(dist)
        if dist.is_main:
            self._commit(staging / tag, target, {**state.resumable(), **self._layout(engine)})
        barrier(dist)
        self.last_saved_step = state.step
        return target

    def _layout(self, engine: Any) -> dict[str, int]:
        return layout_of(self.ctx.config, self.ctx.dist.world_size, engine.ds.zero_optimization_stage())

    def _commit(self, written: Path, target: Path, record: dict[str, Any]) -> None:
        """Mark complete and move into place (rank 0), then drop checkpoints over the limit."""
        atomic_write_text(written / MARKER, json.dumps(record))
        if target.exists():  # a stale checkpoint of an earlier run at the same step
            shutil.rmtree(target)
        os.replace(written, target)
        atomic_write_text(self.output_dir / "latest", target.name)
        limit = self.config.save_total_limit
        if limit:
            for _, old in complete_checkpoints(self.output_dir)[:-limit]:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, engine: Any, state: Any) -> Path | None:
        if not (self.config.enabled and self.config.auto_resume):
            return None
        found = complete_checkpoints(self.output_dir)
        if not found:
            say(f"auto_resume: no complete checkpoint in {self.output_dir}; starting from scratch")
            return None
        _, path = found[-1]
        record = json.loads((path / MARKER).read_text())
        now = self._layout(engine)
        try:
            if record.get("world_size") == now["world_size"]:
                if not engine.load_state(str(self.output_dir), path.name):
                    raise UserError(f"DeepSpeed could not load the checkpoint {path}")
                epoch_step = int(record["epoch_step"])
            else:
                if "zero_stage" not in record:  # written before checkpoints recorded their layout
                    raise UserError(
                        f"checkpoint {path} was written by {record.get('world_size')} processes, this run has "
                        f"{now['world_size']}, and it predates resharding; resume it with the same number of "
                        "processes"
                    )
                for note in reshard_notes(record, now, self.config.accept_batch_change):
                    say(note)
                load_resharded(engine, path, record, self.ctx.dist)
                epoch_step = epoch_step_after(record, now, int(record["epoch_step"]))
        except FileNotFoundError as missing:
            raise UserError(_missing_file(path, record, now, missing)) from None
        for key in ("step", "epoch", "evals"):
            setattr(state, key, int(record[key]))
        state.epoch_step = epoch_step
        state.tracker_ids = dict(record.get("tracker_ids", {}))
        state.counters = {name: float(value) for name, value in record.get("counters", {}).items()}
        own = path / loop_file(self.ctx.dist.rank)
        if record.get("world_size") == now["world_size"] and own.is_file():
            state.rank_state = torch.load(own, weights_only=False)
        set_rng_state(torch.load(rng_file(path, self.ctx.dist.rank), weights_only=False))
        self.last_saved_step = state.step
        return path


def _missing_file(path: Path, record: dict[str, Any], now: dict[str, int], missing: FileNotFoundError) -> str:
    """One line for a checkpoint that lacks a file this run's engine reads: what wrote it, what this run is,
    what to do."""
    name = Path(missing.filename or "?").name
    wrote = (
        f"{record.get('world_size', '?')} process(es) at ZeRO stage {record.get('zero_stage', 'unrecorded')}"
    )
    return (
        f"checkpoint {path} has no {name}, which this run's DeepSpeed engine reads (ZeRO stage "
        f"{now['zero_stage']} on {now['world_size']} process(es)); it was written by {wrote}. Resume it with the "
        "settings that wrote it (deepspeed.zero_optimization, model.dtype, the process count), or start a new "
        "run from its huggingface export"
    )
