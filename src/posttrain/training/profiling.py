"""Profilers that watch the training loop: the PyTorch profiler over a step range, the memory profiler
(``mem_profiler: step | e2e``) and a Python profile of the main rank. Each is an observer with
``step_started(step)`` / ``step_finished(step)`` (1-based optimizer steps) and ``close()``."""

from __future__ import annotations

import cProfile
import json
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config.trainer import TrainerConfig
from posttrain.logs import say
from posttrain.tracking.system import memory_metrics
from posttrain.utils.fs import atomic_write


class TorchProfiler:
    """``torch.profiler`` from ``profile_step_start`` to ``profile_step_end`` (inclusive); a Chrome trace."""

    def __init__(self, config: TrainerConfig, rank: int, device: torch.device) -> None:
        self.config = config.profiling
        self.path = Path(config.logger.output_dir) / "profile" / f"trace-rank{rank}.json"
        self.device = device
        self.profile: Any = None

    def step_started(self, step: int) -> None:
        if step != self.config.profile_step_start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=self.config.record_shapes)
        self.profile.__enter__()

    def step_finished(self, step: int) -> None:
        if self.profile is not None and step >= self.config.profile_step_end:
            self.close()

    def close(self) -> None:
        if self.profile is None:
            return
        profile, self.profile = self.profile, None
        profile.__exit__(None, None, None)
        written = atomic_write(self.path, lambda tmp: profile.export_chrome_trace(str(tmp)))
        say(f"PyTorch profiler trace written to {written}")


class MemoryProfiler:
    """GPU: PyTorch's CUDA memory history, dumped as a snapshot per step (``step``) or once (``e2e``), for
    https://pytorch.org/memory_viz. CPU: one JSON line per step with the process RSS."""

    def __init__(self, config: TrainerConfig, rank: int, device: torch.device) -> None:
        self.mode = config.mem_profiler
        self.directory = Path(config.mem_profiler_dir)
        self.rank, self.device = rank, device
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cuda = device.type == "cuda"
        self.timeline: Any = None
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=config.mem_profiler_max_entries)
        else:
            timeline = self.directory / f"memory-rank{rank}.jsonl"
            self.timeline = open(timeline, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed in close())

    def _snapshot(self, name: str) -> None:
        atomic_write(self.directory / name, lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))

    def step_started(self, step: int) -> None:
        return

    def step_finished(self, step: int) -> None:
        if self.cuda:
            if self.mode == "step":
                self._snapshot(f"memory-rank{self.rank}-step{step}.pickle")
        else:
            self.timeline.write(
                json.dumps({"step": step, "time": time.time(), **memory_metrics(self.device)}) + "\n"
            )

    def close(self) -> None:
        if self.cuda:
            if self.mode == "e2e":
                self._snapshot(f"memory-rank{self.rank}.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
        elif self.timeline is not None:
            self.timeline.close()
            self.timeline = None
        say(f"memory profile written to {self.directory}")


class PythonProfiler:
    """cProfile over the main rank's whole run."""

    def __init__(self, config: TrainerConfig) -> None:
        self.path = Path(config.logger.output_dir) / "profile" / "python-rank0.prof"
        self.profile: cProfile.Profile | None = cProfile.Profile()
        self.profile.enable()

    def step_started(self, step: int) -> None:
        return

    def step_finished(self, step: int) -> None:
        return

    def close(self) -> None:
        if self.profile is None:
            return
        profile, self.profile = self.profile, None
        profile.disable()
        written = atomic_write(self.path, lambda tmp: profile.dump_stats(str(tmp)))
        say(f"Python profile written to {written} (python -m pstats {written})")


def observers(config: TrainerConfig, rank: int, device: torch.device) -> list[Any]:
    found: list[Any] = []
    if config.profiling.use_pytorch_profiler and rank in config.profiling.profile_ranks:
        found.append(TorchProfiler(config, rank, device))
    if config.mem_profiler is not None:
        found.append(MemoryProfiler(config, rank, device))
    if config.profiling.python_profile and rank == 0:
        found.append(PythonProfiler(config))
    return found
