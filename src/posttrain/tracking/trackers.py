"""Experiment trackers (rank 0 only), each optional: Weights & Biases, MLflow, TensorBoard.

A tracker gets every metrics record (training steps and evaluations) with its optimizer step. Its run id is
kept in ``LoopState.tracker_ids`` and saved in resumable checkpoints, so a resumed run logs to the same run.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

from posttrain.config.tracking import MLflowTrackingConfig, TensorBoardConfig
from posttrain.config.wandb import WandBConfig

#: metric-name prefixes each TensorBoard option controls
THROUGHPUT = ("tokens_per_second", "samples_per_second", "tflops", "mfu")


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, without bookkeeping keys."""
    skip = {"iter", "time"}
    return {
        k: float(v)
        for k, v in record.items()
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class Tracker(Protocol):
    name: str

    def start(self, resume_id: str | None) -> str | None: ...

    def log(self, record: dict[str, Any], step: int) -> None: ...

    def finish(self, artifacts: list[Path]) -> None: ...


class WandbTracker:
    name = "wandb"

    def __init__(self, config: WandBConfig, output_dir: Path, run_config: dict[str, Any]) -> None:
        self.config, self.output_dir, self.run_config = config, output_dir, run_config
        self.run: Any = None

    def start(self, resume_id: str | None) -> str | None:
        import wandb

        directory = self.output_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            name=self.config.name,
            dir=str(directory),
            mode=self.config.mode,
            id=resume_id,
            resume="allow" if resume_id else None,
            config=self.run_config,
        )
        return str(self.run.id)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(numeric(record), step=step)

    def finish(self, artifacts: list[Path]) -> None:
        self.run.finish()


def mlflow_location(uri: str) -> tuple[str, Path | None]:
    """(tracking URI, artifact directory for new experiments): a plain local directory becomes a SQLite store
    inside it (MLflow's file store is deprecated)."""
    if "://" in uri or uri.startswith("sqlite:"):
        return uri, None
    directory = Path(uri).expanduser().resolve()
    return f"sqlite:///{directory / 'mlflow.db'}", directory / "artifacts"


class MlflowTracker:
    name = "mlflow"

    def __init__(self, config: MLflowTrackingConfig, output_dir: Path, run_config: dict[str, Any]) -> None:
        self.config, self.output_dir, self.run_config = config, output_dir, run_config
        self.client: Any = None
        self.run_id = ""

    def start(self, resume_id: str | None) -> str | None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri, artifacts = mlflow_location(self.config.mlflow_server_uri)
        if artifacts is not None:
            artifacts.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        run_id = self.config.run_id or resume_id
        if run_id:
            self.run_id = self.client.get_run(run_id).info.run_id
            return self.run_id
        experiment = self.client.get_experiment_by_name(self.config.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                self.config.experiment_name, artifact_location=artifacts.as_uri() if artifacts else None
            )
        )
        run = self.client.create_run(experiment_id, run_name=self.config.run_name or self.output_dir.name)
        self.run_id = run.info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flatten(self.run_config).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        return self.run_id

    def log(self, record: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(key, value, stamp, step) for key, value in numeric(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, artifacts: list[Path]) -> None:
        if self.config.hf_mlflow_log_artifacts:
            for directory in artifacts:
                if directory.is_dir():
                    self.client.log_artifacts(self.run_id, str(directory), artifact_path=directory.name)
        self.client.set_terminated(self.run_id)


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, config: TensorBoardConfig, log_dir: Path) -> None:
        self.config, self.log_dir = config, log_dir
        self.writer: Any = None

    def start(self, resume_id: str | None) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        return None

    def _wanted(self, key: str) -> bool:
        if key.startswith(THROUGHPUT):
            return self.config.log_throughput
        if key.startswith("memory_"):
            return self.config.log_memory
        if key.startswith("time_"):
            return self.config.log_timers
        if key == "params_norm":
            return self.config.log_params_norm
        return key not in ("epoch", "step_time")

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in numeric(record).items():
            if self._wanted(key):
                self.writer.add_scalar(key, value, step)

    def finish(self, artifacts: list[Path]) -> None:
        self.writer.flush()
        self.writer.close()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": 1, "c.0.d": 2}`` from nested dicts and lists."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list) and any(isinstance(x, dict | list) for x in tree):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
