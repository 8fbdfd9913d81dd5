"""``tracking:`` (MLflow, SiloGen's keys), ``tensorboard:``, ``metrics:`` and ``profiling:``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from pydantic import Field

from posttrain.config.base import BaseConfig, ModeKeys, Problem
from posttrain.config.human import HumanFloat, HumanInt


class MLflowTrackingConfig(BaseConfig):
    """MLflow tracking (SiloGen's ``tracking``), rank 0 only."""

    mlflow_server_uri: str
    """Where runs go: a local directory (kept as ``<dir>/mlflow.db`` with artifacts in ``<dir>/artifacts``), a
    ``sqlite:///`` URI, or an ``http(s)://`` tracking server. Credentials belong in the environment
    (``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``); any in the URI are never printed."""

    experiment_name: str
    """The MLflow experiment (created when missing)."""

    run_id: str | None = None
    """Continue logging to this existing run. Null: a new run, or the run saved in the checkpoint being
    resumed."""

    run_name: str | None = None
    """Display name of a new run (null: the output directory's name)."""

    hf_mlflow_log_artifacts: bool = False
    """At the end of training, upload the Hugging Face exports (``huggingface`` checkpoint engines) as run
    artifacts."""


class TensorBoardConfig(BaseConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(
            ("log_dir", "log_throughput", "log_memory", "log_timers", "log_params_norm"),
            lambda c, root: c.enable,
            "tensorboard.enable: true",
        ),
    )
    enable: bool = False
    """Write TensorBoard event files (rank 0)."""

    log_dir: str = ""
    """Where the event files go. Empty: ``<logger.output_dir>/tensorboard``."""

    log_throughput: bool = True
    """Log tokens/s, samples/s, TFLOPS and MFU (and hardware TFLOPS and HFU with activation checkpointing)."""

    log_memory: bool = True
    """Log memory: process RSS on CPU; allocated, reserved and peak on GPU."""

    log_timers: bool = True
    """Log the data / forward / backward / optimizer time split (needs ``metrics.timers: true``)."""

    log_params_norm: bool = False
    """Log the L2 norm of all parameters (one extra pass over the weights per step)."""


class MetricsConfig(BaseConfig):
    timers: bool = False
    """Split each step's time into data, forward, backward and optimizer (``time_*`` metrics). On GPU this
    synchronises the device at each boundary, which costs some overlap."""

    peak_tflops: HumanFloat | None = Field(default=None, gt=0)
    """Peak dense TFLOPS of one device for MFU and HFU. Null: detected by device name for known GPUs (A100,
    H100, H200, B200, MI300X and others: ``tracking/flops.py``) in bf16/fp16; no MFU otherwise."""


class ProfilingConfig(BaseConfig):
    """Megatron-Bridge's profiling keys plus a Python profile (ArcticTraining's ``--python_profile``)."""

    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(
            ("profile_step_start", "profile_step_end", "profile_ranks", "record_shapes"),
            lambda c, root: c.use_pytorch_profiler,
            "profiling.use_pytorch_profiler: true",
        ),
    )

    use_pytorch_profiler: bool = False
    """Run the PyTorch profiler from ``profile_step_start`` to ``profile_step_end`` and write a Chrome trace
    (``<logger.output_dir>/profile/trace-rank<N>.json``, viewable in Perfetto or chrome://tracing)."""

    profile_step_start: HumanInt = Field(default=10, ge=1)
    """First optimizer step profiled."""

    profile_step_end: HumanInt = Field(default=12, ge=1)
    """Last optimizer step profiled."""

    profile_ranks: list[int] = [0]
    """Ranks that run the PyTorch profiler."""

    record_shapes: bool = False
    """Record the input shapes of profiled operators."""

    python_profile: bool = False
    """Profile the main rank's Python code (cProfile) over the whole run into
    ``<logger.output_dir>/profile/python-rank0.prof`` (read with ``python -m pstats`` or snakeviz)."""

    def problems(self) -> Iterator[Problem]:
        if self.profile_step_end < self.profile_step_start:
            yield Problem(
                "profile_step_end",
                f"{self.profile_step_end} is before profile_step_start={self.profile_step_start}",
            )
