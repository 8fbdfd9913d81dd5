"""Build the run's outputs (metrics file, trackers, progress bar) and its step meter from the config."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.config.provenance import redact
from posttrain.context import RunContext
from posttrain.dist import all_reduce_sum
from posttrain.errors import UserError
from posttrain.logs import say
from posttrain.tracking.flops import flops_model, peak_tflops
from posttrain.tracking.metrics import MetricsFile
from posttrain.tracking.outputs import ProgressBar, RunOutputs, wants_progress_bar
from posttrain.tracking.system import StepMeter, Timers, params_norm
from posttrain.tracking.trackers import MlflowTracker, TensorBoardTracker, Tracker, WandbTracker


def trackers_for(ctx: RunContext) -> list[Tracker]:
    """The enabled trackers (rank 0 only; other ranks get none)."""
    config = ctx.config
    if not ctx.dist.is_main:
        return []
    run_config = redact(config.model_dump(mode="json"))
    found: list[Tracker] = []
    if config.wandb.enable:
        found.append(WandbTracker(config.wandb, ctx.output_dir, run_config))
    if config.tracking is not None:
        found.append(MlflowTracker(config.tracking, ctx.output_dir, run_config))
    if config.tensorboard.enable:
        found.append(TensorBoardTracker(config.tensorboard, Path(config.tensorboard.log_dir)))
    return found


#: the record files a run appends to in its output folder (besides the metrics file the config names)
RUN_RECORDS = ("completions.jsonl",)


def set_aside_earlier_records(ctx: RunContext, resumed: bool) -> None:
    """A new run (not ``resumed``) in a folder that holds an earlier run's records: rank 0 moves them into
    ``<logger.output_dir>/earlier-runs/<UTC time>/`` (a rename: nothing is lost) and says so, so the run's
    files hold its own records only; a resumed run continues its files."""
    if resumed or not ctx.dist.is_main:
        return
    import datetime

    metrics = Path(ctx.config.train_log_metrics_path)
    found = [
        p
        for p in (metrics, *(ctx.output_dir / name for name in RUN_RECORDS))
        if p.is_file() and p.stat().st_size
    ]
    if not found:
        return
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    aside = ctx.output_dir / "earlier-runs" / stamp
    aside.mkdir(parents=True, exist_ok=True)
    for path in found:
        path.rename(aside / path.name)
    say(
        f"{ctx.output_dir} held an earlier run's records ({', '.join(p.name for p in found)}): moved to {aside}; "
        "this run writes its own (checkpoint auto_resume continues a run instead)"
    )


def open_outputs(
    ctx: RunContext, tracker_ids: dict[str, str], total_steps: int, done_steps: int
) -> RunOutputs:
    """Start every tracker (continuing the runs in ``tracker_ids`` when resuming; new ids are stored there)."""
    config = ctx.config
    trackers = trackers_for(ctx)
    for tracker in trackers:
        try:
            run_id = tracker.start(tracker_ids.get(tracker.name))
        except ImportError as exc:
            raise UserError(
                f"the {tracker.name} tracker needs a package that is not installed ({exc.name}); "
                "install posttrain's trackers with: pip install 'posttrain[trackers]'"
            ) from None
        except Exception as exc:  # unreachable server, bad credentials, unknown run id: say which tracker
            raise UserError(
                f"the {tracker.name} tracker could not start: {type(exc).__name__}: {redact(str(exc))}"
            ) from None
        if run_id:
            tracker_ids[tracker.name] = run_id
            say(f"{tracker.name}: logging to run {run_id}")
    metrics = MetricsFile(
        config.train_log_metrics_path, enabled=ctx.dist.is_main and config.train_log_iter_interval == 1
    )
    progress = None
    if wants_progress_bar(config.logger.progress_bar, ctx.dist.is_main) and not config.skip_train:
        progress = ProgressBar(total_steps, done_steps)
    return RunOutputs(metrics, trackers, total_steps, progress)


def build_meter(
    ctx: RunContext, model: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> StepMeter:
    config = ctx.config
    norm = None
    if config.tensorboard.enable and config.tensorboard.log_params_norm:
        partitioned = any(hasattr(p, "ds_tensor") for p in model.parameters())

        def norm() -> float:
            squares = float(params_norm(model))
            if partitioned:
                squares = all_reduce_sum([squares], ctx.dist)[0]
            return squares**0.5

    peak = peak_tflops(config.metrics.peak_tflops, device, dtype)
    timers = Timers(config.metrics.timers, device)
    flops = flops_model(model, recompute=not config.model.disable_activation_checkpoint)
    return StepMeter(device, timers, flops, peak, ctx.dist.world_size, norm)


def export_dirs(ctx: RunContext) -> list[Path]:
    """What MLflow uploads with ``hf_mlflow_log_artifacts``: the Hugging Face exports."""
    return [Path(c.output_dir) for c in ctx.config.checkpoint if c.type == "huggingface"]
