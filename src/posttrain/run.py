"""One rank of a training run: build every component from the validated config, train, finish."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from posttrain.config.deepspeed import build_deepspeed_config, single_process_stage
from posttrain.config.mode_keys import inert_warnings
from posttrain.config.provenance import write_resolved_config
from posttrain.config.trainer import TrainerConfig
from posttrain.context import RunContext
from posttrain.data.build import Datasets
from posttrain.data.collate import Collator
from posttrain.data.sampler import ShardSampler
from posttrain.data.views import EvalShard
from posttrain.dataplan import model_facts, plan_data
from posttrain.dist import DistInfo, barrier, init_distributed, seed_everything
from posttrain.engine import Engine
from posttrain.errors import UserError
from posttrain.logs import get_logger, say, setup_logging
from posttrain.loop import LoopInputs, LoopState, final_evaluation, train_loop
from posttrain.methods.token_logps import unwrap
from posttrain.models.expert_parallel import install_expert_parallel
from posttrain.models.facts import ModelFacts, facts_from_model
from posttrain.models.moe import check_moe, routing_recorder, wants_grouped
from posttrain.models.sequence_parallel import (
    SequenceSlicer,
    check_sequence_parallel,
    install_sequence_parallel,
)
from posttrain.models.sequence_parallel import uninstall as uninstall_sequence_parallel
from posttrain.plan import check_rampup, data_parallel_size, lr_explanation, resolve
from posttrain.profiling import observers as profiling_observers
from posttrain.registry import (
    CHECKPOINT_ENGINES,
    MODEL_FACTORIES,
    OPTIMIZERS,
    SCHEDULERS,
    TOKENIZER_FACTORIES,
    TRAINERS,
)
from posttrain.stops import StopSignals
from posttrain.tokenizers.padding import input_pad_id
from posttrain.tracking.setup import build_meter, export_dirs, open_outputs


@dataclass
class RunResult:
    state: LoopState
    output_dir: Path
    model: torch.nn.Module
    resumed_from: Path | None = None


def _loaders(
    ctx: RunContext, data: Datasets, collate: Any
) -> tuple[DataLoader, ShardSampler, DataLoader | None]:
    """Data-parallel shards: the ranks of a sequence-parallel group read the same samples."""
    config = ctx.config
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
    )
    evaluation = None
    if len(data.eval):
        view = data.eval
        if config.eval_iters:  # Megatron: eval_iters global batches, whatever the world size
            global_batch = config.micro_batch_size * config.gradient_accumulation_steps * replicas
            view = view.head(config.eval_iters * global_batch)
        shard = EvalShard(view, replica, replicas)
        evaluation = DataLoader(shard, batch_size=config.micro_batch_size, collate_fn=collate)
    return train, sampler, evaluation


def _zero3_init(ds_config: dict[str, Any]) -> Any:
    """Under ZeRO-3, register the DeepSpeed config with transformers so ``from_pretrained`` creates the
    model already partitioned (``deepspeed.zero.Init``). The returned object must live until the engine exists."""
    if ds_config["zero_optimization"].get("stage") != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def _fit_embeddings(model: torch.nn.Module, tokenizer: Any) -> None:
    """Grow the model's token embeddings when the tokenizer gained tokens (chat-template presets)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(embeddings, "num_embeddings", None)
    if size is None or len(tokenizer) <= size:
        return
    model.resize_token_embeddings(len(tokenizer))
    say(f"token embeddings resized from {size} to {len(tokenizer)} for the added special tokens")
    if getattr(model, "peft_config", None):
        get_logger().warning(
            "the added tokens' embeddings are not trained by the adapter; add embed_tokens and lm_head to "
            "peft_config modules_to_save to train them"
        )


def _model_and_deepspeed(
    ctx: RunContext, tokenizer: Any
) -> tuple[torch.nn.Module, ModelFacts | None, dict[str, Any], Any]:
    """The model, its facts, the DeepSpeed config, and the ZeRO-3 registration with transformers (keep it
    until the engine exists). The factory reports the facts before building when it can, so ZeRO-3 gets its
    config in time to create the model partitioned."""
    config, dist = ctx.config, ctx.dist
    early = model_facts(config)
    if early is not None:
        _resolve_auto_dtype(config, early.dtype)
    sp = config.sequence_parallel_size
    if early is not None:  # before loading any weights
        _check_model(config, early, dist.world_size)

    def deepspeed_config(hidden: int | None) -> dict[str, Any]:
        if hidden is None:
            raise UserError(
                "cannot read the model's hidden size (config.hidden_size) to fill the DeepSpeed config"
            )
        built = build_deepspeed_config(config, world_size=dist.world_size, hidden_size=hidden)
        note = single_process_stage(config.deepspeed.get("zero_optimization", {}).get("stage"), built)
        if note:
            say(note)
        return built

    ds_config = deepspeed_config(early.hidden_size) if early and early.hidden_size else None
    zero3 = _zero3_init(ds_config) if ds_config else None
    model = MODEL_FACTORIES.get(config.model.type).obj(config.model, ctx)
    _fit_embeddings(model, tokenizer)
    facts = facts_from_model(model, early)
    _resolve_auto_dtype(config, str(next(model.parameters()).dtype))
    if ds_config is None:
        ds_config = deepspeed_config(facts.hidden_size if facts else None)
    if early is None and facts is not None:
        _check_model(config, facts, dist.world_size)
    moe = facts.moe if facts else None
    if wants_grouped(config.arctic_moe, config.expert_parallel_size, moe) and moe is not None:
        layout = install_expert_parallel(unwrap(model), config.expert_parallel_size, moe.num_experts)
        say(
            f"MoE layers run grouped: {moe.num_experts} experts per layer, {layout.local} on each of "
            f"{layout.size} expert-parallel processes"
        )
    if sp > 1:
        install_sequence_parallel(
            unwrap(model), sp, config.model.attn_implementation, config.micro_batch_size
        )
    return model, facts, ds_config, zero3


def _check_model(config: TrainerConfig, facts: ModelFacts, world_size: int) -> None:
    """Start-up checks that need the model's facts."""
    if config.sequence_parallel_size > 1:
        check_sequence_parallel(config.sequence_parallel_size, facts, config.model.attn_implementation)
    check_moe(
        facts.moe,
        facts.architecture,
        aux_loss_coef=config.model.router_aux_loss_coef,
        sp=config.sequence_parallel_size,
        arctic_moe=config.arctic_moe,
        expert_parallel_size=config.expert_parallel_size,
        world_size=world_size,
        experts_implementation=config.model.experts_implementation,
    )


def _resolve_auto_dtype(config: TrainerConfig, found: str | None) -> None:
    """``model.dtype: auto`` becomes the checkpoint's dtype (float32 when it names none), so that DeepSpeed's
    mixed precision and the throughput meter follow it."""
    if config.model.dtype != "auto":
        return
    name = (found or "float32").removeprefix("torch.")
    config.model.dtype = name if name in ("float32", "bfloat16", "float16") else "float32"
    say(f"model.dtype auto: {config.model.dtype} (the checkpoint's)")


def run(config: TrainerConfig) -> RunResult:
    """Train one rank. Every rank runs this with the same config."""
    dist = init_distributed()
    try:
        return _run(config, dist)
    finally:
        uninstall_sequence_parallel()


def _run(config: TrainerConfig, dist: DistInfo) -> RunResult:
    original = config
    config, sizes, lr = resolve(config, dist.world_size)
    check_rampup(config.rampup_batch_size, sizes)
    ctx = RunContext(config=config, dist=dist)
    if dist.is_main:
        ctx.output_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(config, ctx.output_dir, dist.world_size)
    barrier(dist)
    setup_logging(config.logger, dist.rank)
    for warning in inert_warnings(config):
        get_logger().warning(warning)
    seed_everything(config.seed)
    spec = TRAINERS.get(config.type).obj

    tokenizer = TOKENIZER_FACTORIES.get(config.tokenizer.type).obj(config.tokenizer, ctx)
    model, facts, ds_config, zero3 = _model_and_deepspeed(ctx, tokenizer)

    data_plan = plan_data(ctx, sizes, lr, tokenizer, facts)
    data, plan, total_steps = data_plan.data, data_plan.step_plan, data_plan.total_steps
    say(data.train_report.summary("train data"))
    if data.eval:
        say(data.eval_report.summary("eval data"))
    if data.train_report.leaked:
        get_logger().warning(
            "%d eval rows are identical to training rows: the eval loss will look better than it is",
            data.train_report.leaked,
        )
    pad_id = input_pad_id(tokenizer, config.tokenizer.missing_pad_token_strategy)
    padding_free = config.data.padding_free
    collator: Any = spec.collator(pad_id) if spec.collator else Collator(pad_id, padding_free)
    sp = config.sequence_parallel_size
    if sp > 1:
        collator = SequenceSlicer(collator, pad_id, sp, dist.rank % sp, config.micro_batch_size)
    train_loader, sampler, eval_loader = _loaders(ctx, data, collator)
    steps_per_epoch = data_plan.steps_per_epoch
    if total_steps == 0 and not config.skip_train:
        raise UserError("nothing to train: epochs is 0 and train_iters is 0")

    optimizer = OPTIMIZERS.get(config.optimizer.type).obj(config.optimizer, model, ctx)
    scheduler = SCHEDULERS.get(config.scheduler.type).obj(config.scheduler, optimizer, total_steps, ctx)
    engine = Engine(model, optimizer, scheduler, ds_config)
    del zero3
    checkpoints = [CHECKPOINT_ENGINES.get(c.type).obj(c, ctx, tokenizer) for c in config.checkpoint]
    state = LoopState()
    if spec.prepare is not None:
        spec.prepare(ctx, engine, data, collator)  # before resuming: sees the initial weights
    resumed_from = None
    for checkpoint in checkpoints:
        resumed_from = resumed_from or checkpoint.load(engine, state)
    if resumed_from is not None:
        say(
            f"resumed from {resumed_from} (step {state.step}, epoch {state.epoch}, step {state.epoch_step} of it)"
        )

    outputs = open_outputs(ctx, state.tracker_ids, total_steps, state.step)
    say(
        f"training {config.type}: {len(data.train)} sequences, {steps_per_epoch} steps/epoch, "
        f"{total_steps} steps, world size {dist.world_size}, global batch {sizes.global_batch_size} "
        f"(micro-batch {sizes.micro_batch_size} x accumulation {sizes.gradient_accumulation_steps} "
        f"x {sizes.world_size} data-parallel processes"
        + (f", each sample split over {sp} processes)" if sp > 1 else ")")
    )
    say(lr_explanation(original, sizes, lr))
    stops = StopSignals(config.exit_duration_in_mins)
    inputs = LoopInputs(
        engine=engine,
        loss_fn=spec.loss(config),
        train_loader=train_loader,
        set_epoch=sampler.set_epoch,
        eval_loader=eval_loader,
        checkpoints=checkpoints,
        outputs=outputs,
        total_steps=total_steps,
        step_plan=plan,
        stops=stops,
        meter=build_meter(ctx, engine.module, engine.device, getattr(torch, config.model.dtype)),
        observers=profiling_observers(config, dist.rank, engine.device),
        perplexity=spec.perplexity,
        routing=routing_recorder(
            unwrap(engine.module), facts.moe if facts else None, config.model.router_aux_loss_coef
        ),
    )
    if inputs.routing is not None:
        routing = inputs.routing
        say(
            f"mixture of experts: {routing.facts.num_experts} experts per layer in {routing.layers} layers, "
            f"{routing.facts.top_k} per token; router loss x {routing.coefficient:g} added to the training "
            "loss (router_aux_loss), expert load at the metrics interval"
        )
    stops.install()
    if config.manual_gc:
        gc.disable()
    try:
        if not config.skip_train:
            train_loop(ctx, inputs, state)
        if not state.stop_reason:
            final_evaluation(ctx, inputs, state)
        if config.skip_train:
            return RunResult(state=state, output_dir=ctx.output_dir, model=engine.module)
        for checkpoint in checkpoints:
            if checkpoint.due(step=state.step, end=True, early=bool(state.stop_reason)):
                say(f"saved {checkpoint.save(engine, state, end=True)}")
        barrier(dist)
    finally:
        stops.uninstall()
        for observer in inputs.observers:
            observer.close()
        outputs.close(export_dirs(ctx))
        if config.manual_gc:
            gc.enable()
    if state.stop_reason:
        say(f"stopped early at step {state.step}: {state.stop_reason}")
    if dist.is_main and os.path.exists(config.kill_switch_path):
        os.remove(config.kill_switch_path)
        say(f"removed the kill switch {config.kill_switch_path} so the next run starts normally")
    return RunResult(state=state, output_dir=ctx.output_dir, model=engine.module, resumed_from=resumed_from)


__all__ = ["RunResult", "run"]
