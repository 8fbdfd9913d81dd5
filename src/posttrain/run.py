"""One rank of a training run, as its stages: set up, load and prepare the model, plan the batches, assemble
the loop's inputs (engine, checkpoints, resume, outputs), then train and finish. Each stage's work lives in
its own module; this file only orders them."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from posttrain.config.mode_keys import config_warnings
from posttrain.config.provenance import write_resolved_config
from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.data.collate import Collator, HostPrepared
from posttrain.data.sampler import ShardSampler
from posttrain.data.views import EvalShard
from posttrain.dist import DistInfo, barrier, init_distributed, seed_everything
from posttrain.errors import UserError
from posttrain.inference.harness_training import evaluators_for
from posttrain.logs import get_logger, say, setup_logging
from posttrain.models.sequence_parallel import SequenceSlicer
from posttrain.models.sequence_parallel import uninstall as uninstall_sequence_parallel
from posttrain.plan import Batches, BatchSizes, DataPlan, data_parallel_size, lr_explanation, resolve
from posttrain.registry import (
    CHECKPOINT_ENGINES,
    OPTIMIZERS,
    SCHEDULERS,
    TOKENIZER_FACTORIES,
    TRAINERS,
    load_component,
)
from posttrain.stages.data import plan_data
from posttrain.stages.model import LoadedModel, load_model, step_extras
from posttrain.tokenizers.padding import input_pad_id
from posttrain.tracking.setup import build_meter, export_dirs, open_outputs, set_aside_earlier_records
from posttrain.training.engine import Engine
from posttrain.training.loop import LoopInputs, LoopState, final_evaluation, train_loop
from posttrain.training.profiling import observers as profiling_observers
from posttrain.training.stops import StopSignals, ignore_stop_signals, note_stopped
from posttrain.vision.collate import with_image_batches


@dataclass
class RunResult:
    state: LoopState
    output_dir: Path
    model: torch.nn.Module
    resumed_from: Path | None = None


@dataclass
class Setup:
    """What every later stage reads: the config resolved for the world size, this rank, the method."""

    ctx: RunContext
    original: TrainerConfig  # as written (the LR explanation compares against it)
    sizes: BatchSizes
    lr: float
    spec: Any  # the trainer's TrainerSpec


def run(config: TrainerConfig) -> RunResult:
    """Train one rank. Every rank runs this with the same config."""
    dist = init_distributed()
    try:
        return _run(config, dist)
    finally:
        uninstall_sequence_parallel()


def _run(config: TrainerConfig, dist: DistInfo) -> RunResult:
    setup = set_up(config, dist)
    tokenizer = TOKENIZER_FACTORIES.get(setup.ctx.config.tokenizer.type).obj(
        setup.ctx.config.tokenizer, setup.ctx
    )
    loaded = load_model(setup.ctx, tokenizer)
    batches = plan_batches(setup, tokenizer, loaded)
    inputs, state, resumed_from = loop_inputs(setup, loaded, batches, tokenizer)
    return train_and_finish(setup, inputs, state, resumed_from)


def set_up(config: TrainerConfig, dist: DistInfo) -> Setup:
    """Resolve the config for the world size, write it beside the outputs, start logging, seed."""
    resolved, sizes, lr = resolve(config, dist.world_size)
    ctx = RunContext(config=resolved, dist=dist)
    if dist.is_main:
        ctx.output_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(resolved, ctx.output_dir, dist.world_size)
    barrier(dist)
    setup_logging(resolved.logger, dist.rank)
    for warning in config_warnings(resolved):
        get_logger().warning(warning)
    seed_everything(resolved.seed)
    return Setup(ctx, config, sizes, lr, TRAINERS.get(resolved.type).obj)


def plan_batches(setup: Setup, tokenizer: Any, loaded: LoadedModel) -> Batches:
    """The data (built or opened from the cache), the step plan, the collator and the loaders."""
    ctx = setup.ctx
    config = ctx.config
    plan = plan_data(ctx, setup.sizes, setup.lr, tokenizer, loaded.facts)
    ctx.config = plan.config  # step intervals given as fractions of the run are steps from here on
    _report_data(plan)
    if plan.total_steps == 0 and not config.skip_train:
        raise UserError("nothing to train: epochs is 0 and train_iters is 0")
    pad_id = input_pad_id(tokenizer, config.tokenizer.missing_pad_token_strategy)
    spec = setup.spec
    collator: Any = (
        load_component(spec.collator)(pad_id) if spec.collator else Collator(pad_id, config.data.padding_free)
    )
    sp = config.sequence_parallel_size
    if sp > 1:
        collator = SequenceSlicer(collator, pad_id, sp, ctx.dist.rank % sp, config.micro_batch_size)
    collator = with_image_batches(collator, tokenizer)  # a vision-language model's images beside the tokens
    collator = HostPrepared(collator)  # what the device would otherwise be asked for, once per micro-batch
    train, sampler, evaluation = _loaders(ctx, plan, collator)
    return Batches(plan, collator, train, sampler, evaluation)


def _report_data(plan: DataPlan) -> None:
    data = plan.data
    say(data.train_report.summary("train data"))
    if data.eval:
        say(data.eval_report.summary("eval data"))
    if data.train_report.leaked:
        get_logger().warning(
            "%d eval rows are identical to training rows: the eval loss will look better than it is",
            data.train_report.leaked,
        )


def _loaders(
    ctx: RunContext, plan: DataPlan, collate: Any
) -> tuple[DataLoader, ShardSampler, DataLoader | None]:
    """Data-parallel shards: the ranks of a sequence-parallel group read the same samples."""
    config, data = ctx.config, plan.data
    replicas = data_parallel_size(config, ctx.dist.world_size)
    replica = ctx.dist.rank // config.sequence_parallel_size  # a group is consecutive ranks
    sampler = ShardSampler(len(data.train), replicas, replica, seed=config.data.seed)
    workers = config.data.dl_num_workers
    train = DataLoader(
        data.train,
        batch_size=config.micro_batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=ignore_stop_signals if workers else None,
    )
    if not len(data.eval):
        return train, sampler, None
    view = data.eval
    if config.eval_iters:  # Megatron: eval_iters global batches, whatever the world size
        view = view.head(config.eval_iters * plan.sizes.global_batch_size)
    shard = EvalShard(view, replica, replicas)
    return train, sampler, DataLoader(shard, batch_size=config.micro_batch_size, collate_fn=collate)


def loop_inputs(
    setup: Setup, loaded: LoadedModel, batches: Batches, tokenizer: Any
) -> tuple[LoopInputs, LoopState, Path | None]:
    """The engine, the checkpoint engines (resuming from one), the outputs, and everything the loop reads."""
    ctx, spec, plan = setup.ctx, setup.spec, batches.plan
    config = ctx.config
    engine = _engine(ctx, loaded, plan.total_steps)
    checkpoints = [CHECKPOINT_ENGINES.get(c.type).obj(c, ctx, tokenizer) for c in config.checkpoint]
    if spec.prepare is not None:
        load_component(spec.prepare)(
            ctx, engine, plan.data, batches.collator
        )  # before resuming: sees the initial weights
    state, resumed_from = _resume(checkpoints, engine)
    set_aside_earlier_records(ctx, resumed=resumed_from is not None)  # before the step feed opens its log
    steps = load_component(spec.steps)(ctx, engine, batches, tokenizer)
    # checked before output; an online run's engine with weights of its own generates the harness's tasks
    evaluators = evaluators_for(config, engine.module, tokenizer, ctx.dist, steps.generation)
    inputs = LoopInputs(
        engine=engine,
        loss_fn=load_component(spec.loss)(config, tokenizer, steps),
        steps=steps,
        eval_loader=batches.eval,
        checkpoints=checkpoints,
        outputs=open_outputs(ctx, state.tracker_ids, plan.total_steps, state.step),
        total_steps=plan.total_steps,
        step_plan=plan.step_plan,
        stops=StopSignals(config.exit_duration_in_mins, ctx.stopping),
        meter=build_meter(ctx, engine.module, engine.device, getattr(torch, config.model.dtype)),
        observers=profiling_observers(config, ctx.dist.rank, engine.device),
        perplexity=spec.perplexity,
        extras=[*step_extras(engine.module, loaded.facts, config), *steps.extras],
        evaluators=evaluators,
    )
    _announce(setup, batches, inputs)
    return inputs, state, resumed_from


def _engine(ctx: RunContext, loaded: LoadedModel, total_steps: int) -> Engine:
    config = ctx.config
    optimizer = OPTIMIZERS.get(config.optimizer.type).obj(config.optimizer, loaded.model, ctx)
    scheduler = SCHEDULERS.get(config.scheduler.type).obj(config.scheduler, optimizer, total_steps, ctx)
    engine = Engine(loaded.model, optimizer, scheduler, loaded.deepspeed, loaded.features)
    loaded.zero3 = None  # the engine exists: transformers no longer needs ZeRO-3's registration
    return engine


def _resume(checkpoints: list[Any], engine: Engine) -> tuple[LoopState, Path | None]:
    state, resumed_from = LoopState(), None
    for checkpoint in checkpoints:
        resumed_from = resumed_from or checkpoint.load(engine, state)
    if resumed_from is not None:
        say(
            f"resumed from {resumed_from} (step {state.step}, epoch {state.epoch}, step {state.epoch_step} of it)"
        )
    return state, resumed_from


def _announce(setup: Setup, batches: Batches, inputs: LoopInputs) -> None:
    """The start lines: what is trained, on how many processes, with which batch and LR."""
    config, sizes, plan = setup.ctx.config, setup.sizes, batches.plan
    sp = config.sequence_parallel_size
    say(
        f"training {config.type}: {len(plan.data.train)} sequences, {plan.steps_per_epoch} steps/epoch, "
        f"{plan.total_steps} steps, world size {setup.ctx.dist.world_size}, global batch "
        f"{sizes.global_batch_size} (micro-batch {sizes.micro_batch_size} x accumulation "
        f"{sizes.gradient_accumulation_steps} x {sizes.world_size} data-parallel processes"
        + (f", each sample split over {sp} processes)" if sp > 1 else ")")
    )
    say(lr_explanation(setup.original, sizes, setup.lr))
    for part in [*inputs.extras, *inputs.evaluators]:
        say(part.describe())


def train_and_finish(
    setup: Setup, inputs: LoopInputs, state: LoopState, resumed_from: Path | None
) -> RunResult:
    """Train, evaluate at the end, save the final checkpoints, close every output."""
    ctx = setup.ctx
    config = ctx.config
    inputs.stops.install()
    if config.manual_gc:
        gc.disable()
    try:
        if not config.skip_train:
            train_loop(ctx, inputs, state)
        if not state.stop_reason:
            final_evaluation(ctx, inputs, state)
        if not config.skip_train:
            _final_checkpoints(ctx, inputs, state)
    finally:
        _close(ctx, inputs)
    if config.skip_train:
        return RunResult(state=state, output_dir=ctx.output_dir, model=inputs.engine.module)
    if state.stop_reason:
        say(f"stopped early at step {state.step}: {state.stop_reason}")
        note_stopped()
    _remove_kill_switch(ctx)
    return RunResult(state, ctx.output_dir, inputs.engine.module, resumed_from=resumed_from)


def _final_checkpoints(ctx: RunContext, inputs: LoopInputs, state: LoopState) -> None:
    for checkpoint in inputs.checkpoints:
        if checkpoint.due(step=state.step, end=True, early=bool(state.stop_reason)):
            say(f"saved {checkpoint.save(inputs.engine, state, end=True)}")
    barrier(ctx.dist)


def _close(ctx: RunContext, inputs: LoopInputs) -> None:
    inputs.stops.uninstall()
    for observer in inputs.observers:
        observer.close()
    for part in [*inputs.extras, *inputs.evaluators]:
        part.close()
    inputs.outputs.close(export_dirs(ctx))
    if ctx.config.manual_gc:
        gc.enable()


def _remove_kill_switch(ctx: RunContext) -> None:
    path = ctx.config.kill_switch_path
    if ctx.dist.is_main and os.path.exists(path):
        os.remove(path)
        say(f"removed the kill switch {path} so the next run starts normally")


__all__ = ["RunResult", "run"]
