"""The step feed every online method shares: batches of prompts become sampled completions, which the method
turns into training micro-batches (``OnlineMethod``); what is generic lives here: the prompt order, each
rank's completion slots, the generation engine (transformers or vLLM) and its weight pushes, the keyed draws,
the generation's step metrics, the trainer state handed to user functions, the resume of a batch between its
updates and the completions log.

For batch k of epoch e, the prompts are items ``k*P .. (k+1)*P - 1`` of the epoch's permutation of the prompt
data (``data.seed`` and the epoch, the same order for any process count), P = global batch / G, G the
completions per prompt. The batch's completion slots are laid out prompt by prompt (slot s: prompt s // G,
completion s % G) and every rank takes its contiguous share (a group may straddle ranks). Each completion is
drawn from its own key (``generation.completion_key``), so the completions do not depend on the process count
or the batch's composition.

With several updates per batch (grpo's ``num_iterations``) the batch's micro-batches are kept in the loop state
of this rank, which resumable checkpoints save, so a run killed between two updates of a batch resumes on it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.context import RunContext
from posttrain.data.prompts import ORIGIN_KEY, prompt_of
from posttrain.data.samples import IGNORE_INDEX, JOINED, joined_rows, pad_rows, target_labels, target_rows
from posttrain.dist import all_reduce_sum
from posttrain.errors import UserError
from posttrain.generation.engine import EngineCopy
from posttrain.generation.types import (
    Completions,
    GenerationEngine,
    GenerationStopped,
    Sampling,
)
from posttrain.models.document_attention import joins_rows
from posttrain.models.token_logps import unwrap
from posttrain.rollout.sampler import RolloutSampler
from posttrain.rollout.sequence_split import sequence_split
from posttrain.rollout.slots import PromptSlots
from posttrain.tracking.metrics import MetricsFile
from posttrain.vision.collate import attach_images, prompt_images


@dataclass
class GeneratedBatch:
    """One rank's share of a generated batch: its completion slots, the prompts' rows (decoded, with every
    column), the prompts' token ids and the sampled completions (which ``after_generation`` may replace:
    dynamic sampling refills the batch)."""

    epoch: int
    batch: int
    first: int  # this rank's first slot of the batch
    slots: range
    rows: list[dict[str, Any]]  # per slot: its prompt's row
    prompt_ids: list[list[int]]
    completions: Completions
    #: the policy version of the weights it was generated from (batches trained before them) and its staleness
    #: (batches trained since: 0 on policy; generated ahead, up to ``max_staleness``)
    version: int = 0
    staleness: int = 0


class BatchGivenUp(Exception):
    """A refill round of a batch gave up at a stop (its servers gone): the batch is not trained."""


#: a per-completion value of ``after_generation``: 1 in the loss, 0 left out (its tokens' mask is 0)
IN_LOSS = "in_loss"


@dataclass
class GenerationStats:
    """What a method makes of a generated batch (``OnlineMethod.after_generation``; torchtune's ``GRPOStats``
    shape): per-completion values for the loss (``[this rank's completions]`` tensors, sliced into the
    micro-batches under their names) and the batch's records (the same on every rank: gather first)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    records: dict[str, Any] = field(default_factory=dict)


class OnlineMethod:
    """What an online method adds to the shared feed (``OnlineSteps``): subclass it and define
    ``after_generation``. Every other part is declared here with what a method that needs nothing more does."""

    #: the engine's log-probabilities of its samples are asked for (a correction of the engine's mismatch)
    wants_sampling_logps: bool = False
    #: completions cut at ``max_completion_length`` (no end of turn) are left out of the loss
    mask_truncated: bool = False

    def completions_for(
        self,
        feed: OnlineSteps,
        epoch: int,
        batch: int,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        keys: list[int],
    ) -> Completions | None:
        """The batch's completions from elsewhere (the data's, another model's: distill's GKD mixing); None:
        the policy samples them."""
        return None

    def after_generation(self, feed: OnlineSteps, generated: GeneratedBatch) -> GenerationStats:
        """The batch's per-completion training values (e.g. grpo's advantages) and its records; every rank
        calls it at once (it may gather across ranks)."""
        raise NotImplementedError

    def finish_batches(
        self, feed: OnlineSteps, generated: GeneratedBatch, micro_batches: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Add what the method's loss needs to the micro-batches (log-probabilities of other models...); the
        records that come of it (the same on every rank), added to the batch's."""
        return {}

    def log_fields(self, feed: OnlineSteps, generated: GeneratedBatch, index: int) -> dict[str, Any]:
        """The method's fields of completion ``index``'s line in ``completions.jsonl``."""
        return {}

    def describe(self) -> str:
        """One line for the run's start."""
        return type(self).__name__

    def close(self) -> None:
        """Release what the method holds (reward workers...) when the run ends."""


class RolloutMetrics:
    """A step extra carrying each generation's records into the step records (the method makes them the same
    on every rank), the generation's time and share of the step; it marks the generation engine's copy of the weights
    stale after every update."""

    def __init__(self, method: OnlineMethod, backend: GenerationEngine) -> None:
        self.method, self.backend = method, backend
        self.latest: dict[str, Any] = {}
        self.generation_time = 0.0
        self.scoring_time = 0.0  # the method's work on the completions (rewards, a teacher's scores...)
        self.yielded_at = time.perf_counter()
        self.closing: list[Any] = []  # the step feed's own closing (its log, its generation engine)

    def recording(self) -> Any:
        return nullcontext()

    def micro_batch(self, batch: dict[str, Any], micro_batches: int) -> tuple[None, dict[str, torch.Tensor]]:
        return None, {}

    def step_values(self, sums: dict[str, float], micro_batches: int, report: bool) -> dict[str, list[float]]:
        self.backend.mark_stale()  # the update changed the weights: an engine's copy is old
        return {}

    def metrics(self, reduced: dict[str, list[float]], report: bool) -> dict[str, Any]:
        training = time.perf_counter() - self.yielded_at
        share = self.generation_time / (self.generation_time + training) if training > 0 else 0.0
        out = {**self.latest, "time_generation": self.generation_time, "generation_share": share}
        out["time_scoring"] = self.scoring_time
        self.generation_time = self.scoring_time = 0.0  # the batch's next updates generate nothing
        return out

    def describe(self) -> str:
        return self.method.describe()

    def close(self) -> None:
        for close in self.closing:
            close()


class OnlineSteps:
    """The step feed (``TrainerSpec.steps``) of an online method: see the module docstring. ``group``:
    completions per prompt; ``updates``: optimizer steps per generated batch; ``state_key``: where a batch
    waiting for its next update is kept in the loop state."""

    def __init__(
        self,
        ctx: RunContext,
        engine: Any,
        batches: Any,
        tokenizer: Any,
        method: OnlineMethod,
        *,
        group: int,
        updates: int = 1,
        state_key: str = "online",
    ) -> None:
        config, plan = ctx.config, batches.plan
        self.ctx, self.engine, self.config = ctx, engine, config
        self.tokenizer, self.method = tokenizer, method
        self.step_plan, self.total_steps = plan.step_plan, plan.total_steps
        self.group, self.updates, self.state_key = group, updates, state_key
        self.micro = plan.sizes.micro_batch_size
        self.slots = PromptSlots.of_run(ctx, plan, group, updates)
        self.mine = self.slots.mine  # completions this rank generates of a batch
        sampler = self.sampler = RolloutSampler(ctx, engine.module, tokenizer, plan.data, self.mine)
        self.sampling, self.stops, self.pad_id = sampler.sampling, sampler.stops, sampler.pad_id
        self.split = sequence_split(config, ctx.dist.rank, self.pad_id)  # rows over sequence-parallel ranks
        self.joins = joins_rows(config.padding_free, unwrap(engine.module), self.split is not None)
        self.counters: dict[str, float] = {}  # the loop state's (steps() takes them from it)
        self.trainer_state = trainer_state(ctx, self.total_steps, 0, 0, 0, 1)  # before the first generation
        self.metrics = RolloutMetrics(method, sampler.backend)
        self.extras = [self.metrics]
        self.log = CompletionsLog.of_run(ctx, tokenizer)
        self.metrics.closing += [self.close, method.close]
        if config.generates_ahead:  # max_staleness, weight_sync_steps: rollout/ahead.py
            total = min(self.slots.offsets[-1], -(-self.total_steps // updates))
            sampler.start_ahead(config, engine.module, self._generate_ahead, total, ctx.dist.world_size)
        # the batches: generated when due (OnPolicy), or ahead (rollout/ahead.py)
        self.source = sampler.source

    @property
    def generation(self) -> EngineGeneration | None:
        """The run's engine for greedy generations beside the steps (the harness tasks), None where generation
        runs on the training weights (the evaluators use the training model then)."""
        backend = self.sampler.backend
        return EngineGeneration(self, backend) if isinstance(backend, EngineCopy) else None

    # ------------------------------------------------------------------------------------------ the loop

    def steps(self, state: Any) -> Iterator[list[dict[str, Any]]]:
        epoch = state.epoch
        batches = len(self.step_plan[epoch]) // self.updates
        first, done = divmod(state.epoch_step, self.updates)
        self.counters = state.counters  # run-long totals, saved with resumable checkpoints
        for batch in range(first, batches):
            self.trainer_state = trainer_state(self.ctx, self.total_steps, state.step, epoch, batch, batches)
            micro_batches = self._resumed(state, done) if done else self._generate(epoch, batch, state)
            if micro_batches is None:  # a stop came while its servers were gone: saved after the last step
                state.stop_reason = (
                    f"a stop signal came while step {state.step + 1}'s batch was generated and every vLLM server "
                    "was gone; that step was not trained"
                )
                return
            if self.updates > 1:  # what the batch's next updates need after a resume
                state.rank_state[self.state_key] = {
                    "epoch": epoch,
                    "batch": batch,
                    "micro_batches": micro_batches,
                    "metrics": dict(self.metrics.latest),
                }
            for _ in range(done, self.updates):
                self.metrics.yielded_at = time.perf_counter()
                yield micro_batches
            done = 0
        state.rank_state.pop(self.state_key, None)

    def _resumed(self, state: Any, done: int) -> list[dict[str, Any]]:
        saved = state.rank_state.get(self.state_key)
        if saved is None or (saved["epoch"], saved["batch"]) != (
            state.epoch,
            state.epoch_step // self.updates,
        ):
            raise UserError(
                f"resuming after update {done} of the {self.updates} of a generated batch, whose completions this "
                "rank's checkpoint does not hold (it was written by another number of processes); resume with the "
                "process count that wrote it, or from a checkpoint at a batch boundary"
            )
        self.metrics.latest = dict(saved["metrics"])
        return saved["micro_batches"]

    # ----------------------------------------------------------------------------------------- a rollout

    def refill(self, epoch: int, batch: int, round_: int) -> GeneratedBatch:
        """Refill round ``round_`` of a batch (dynamic sampling): P more prompts (``PromptSlots.refill_positions``), G
        completions each from the current weights (after the batches generated ahead are waited for), laid
        out over the processes as the batch is. Every process calls it at once."""
        first, slots, rows, prompt_ids, keys = self.slots.take(epoch, batch, round_)
        started, stopped = time.perf_counter(), False
        completions = Completions([], [])
        try:
            completions = self.complete(
                self.engine.module, rows, prompt_ids, self.sampling, keys, self.logprobs()
            )
        except GenerationStopped:
            stopped = True
        if given_up(stopped, self.ctx):
            raise BatchGivenUp
        self.metrics.generation_time += time.perf_counter() - started
        index = self.slots.global_batch(epoch, batch)
        prompt_ids = completions.prompt_ids or prompt_ids
        return GeneratedBatch(epoch, batch, first, slots, rows, prompt_ids, completions, index, 0)

    def _generate(self, epoch: int, batch: int, state: Any) -> list[dict[str, Any]] | None:
        """This rank's completions of the batch, the method's values for them, and the micro-batches (None:
        the generation gave up at a stop, on some process)."""
        first, slots, slot_rows, prompt_ids, keys = self.slots.take(epoch, batch)
        started = time.perf_counter()
        index = version = self.slots.global_batch(epoch, batch)
        ahead: Completions | None = None
        completions: Completions | None = None
        stopped = False
        try:
            ahead, version = self.source.take_for(index, state)  # None: generated now, from these weights
            completions = self.method.completions_for(self, epoch, batch, slot_rows, prompt_ids, keys)
            if completions is None:  # the policy's own samples
                completions = ahead or self.complete(
                    self.engine.module, slot_rows, prompt_ids, self.sampling, keys, self.logprobs()
                )
        except GenerationStopped:
            stopped = True
        if given_up(stopped, self.ctx) or completions is None:
            return None
        prompt_ids = completions.prompt_ids or prompt_ids
        self.metrics.generation_time = time.perf_counter() - started
        generated = GeneratedBatch(
            epoch, batch, first, slots, slot_rows, prompt_ids, completions, version, index - version
        )
        started, generating = time.perf_counter(), self.metrics.generation_time
        try:
            stats = self.method.after_generation(self, generated)
        except BatchGivenUp:  # a refill round (dynamic sampling) gave up at a stop
            return None
        refilling = self.metrics.generation_time - generating  # dynamic sampling's rounds
        self.metrics.scoring_time = time.perf_counter() - started - refilling
        completions = generated.completions  # dynamic sampling may have refilled the batch
        self.metrics.latest = dict(stats.records)
        if self.sampler.turns is not None:
            self.metrics.latest.update(tool_records(completions, self.ctx.dist))
            self.metrics.latest.update(turn_records(self.sampler.turns.records(), self.ctx.dist))
        self.metrics.latest.update(self.source.records(index, version))
        micro_batches = self.micro_batches(
            generated.prompt_ids, completions, stats.values, prompt_images(generated.rows)
        )
        self.metrics.latest.update(self.method.finish_batches(self, generated, micro_batches))
        self._log(generated)
        return micro_batches

    def _generate_ahead(self, index: int, backend: GenerationEngine) -> Completions:
        """Batch ``index``'s completions for this rank, generated ahead (on the background thread) from what the
        engine holds; the trainer state user functions see is the one of the weights it comes from."""
        epoch, batch, batches = self.slots.place(index)
        _, _, rows, prompt_ids, keys = self.slots.take(epoch, batch)
        state = trainer_state(self.ctx, self.total_steps, 0, epoch, batch, batches)
        state.global_step = self.source.version(index) * self.updates
        return self.sampler.complete(
            self.engine.module, rows, prompt_ids, self.sampling, keys, self.logprobs(), backend, state
        )

    def complete(
        self,
        module: torch.nn.Module,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool = False,
    ) -> Completions:
        """Completions of the rows' prompts from the current weights (``RolloutSampler.complete``)."""
        return self.sampler.complete(
            module, rows, prompt_ids, sampling, keys, logprobs, None, self.trainer_state
        )

    def logprobs(self) -> bool:
        """Whether the engine returns its sampled tokens' log-probabilities (a method that corrects for the
        engine's mismatch asks)."""
        return self.method.wants_sampling_logps

    def micro_batches(
        self,
        prompt_ids: list[list[int]],
        completions: Completions,
        values: dict[str, torch.Tensor],
        images: list[list[Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """The completions as training micro-batches (``training_micro_batches``), given their prompts' image
        inputs (``images``: each row's, a vision-language run)."""
        if self.split is not None:  # the group's completions, each micro-batch cut to this rank's slice
            prompt_ids, completions, values = self.split.gather(prompt_ids, completions, values)
        batches = training_micro_batches(
            prompt_ids, completions, values, self.micro, self.pad_id, self.method.mask_truncated, self.joins
        )
        if self.split is not None:
            batches = [self.split.cut(batch) for batch in batches]
        return attach_images(batches, images or [], self.sampler.processor)

    def _log(self, generated: GeneratedBatch) -> None:
        """Rank 0's completions of every ``completions_log_interval``-th generated batch of the run, each with
        the policy version it was sampled from (the batches trained before its weights)."""
        generation = self.slots.global_batch(generated.epoch, generated.batch)
        if self.config.log_completions and not generation % self.config.completions_log_interval:
            fields = [
                {**self.method.log_fields(self, generated, i), "policy_version": generated.version}
                for i in range(len(generated.rows))
            ]
            self.log.write(generation, generated, fields)

    def close(self) -> None:
        self.sampler.close()
        self.log.close()


def trainer_state(ctx: RunContext, total_steps: int, step: int, epoch: int, batch: int, batches: int) -> Any:
    """What TRL hands user functions as ``trainer_state``: transformers' ``TrainerState`` at a generation
    (the optimizer steps done, the run's total, the epoch as a fraction)."""
    from transformers import TrainerState

    config, dist = ctx.config, ctx.dist
    return TrainerState(
        epoch=epoch + batch / max(batches, 1),
        global_step=step,
        max_steps=total_steps,
        num_train_epochs=config.epochs,
        logging_steps=config.loss_log_interval,
        train_batch_size=config.micro_batch_size,
        is_local_process_zero=dist.local_rank == 0,
        is_world_process_zero=dist.is_main,
    )


def given_up(here: bool, ctx: RunContext) -> bool:
    """Whether a process's generation of a batch gave up at a stop (its servers gone): every process agrees
    before any of them trains or saves (one number summed, on server runs of several processes)."""
    if ctx.dist.world_size > 1 and ctx.config.use_vllm and ctx.config.vllm_mode == "server":
        return all_reduce_sum([float(here)], ctx.dist)[0] > 0
    return here


def model_labels(completions: Completions, index: int) -> list[int]:
    """A completion's labels: its tokens, the tools' (``tool_mask`` 0) ignored."""
    ids, mask = completions.ids[index], completions.tool_mask
    if mask is None:
        return list(ids)
    return [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask[index], strict=True)]


def tool_records(completions: Completions, dist: Any) -> dict[str, float]:
    """TRL's tool records over every rank's completions of a batch: ``tools/call_frequency`` (calls per
    completion) and ``tools/failure_frequency`` (failed calls per call, 0 without calls)."""

    calls, failures, count = all_reduce_sum(
        [float(completions.tool_calls), float(completions.tool_failures), float(len(completions.ids))], dist
    )
    return {
        "tools/call_frequency": calls / count,
        "tools/failure_frequency": failures / calls if calls else 0.0,
    }


def turn_records(local: dict[str, float], dist: Any) -> dict[str, float]:
    """A multi-turn rollout's own counts (an agent endpoint's episodes, calls, branches...) summed over every
    rank; ``agent/*`` counts become TRL-style means per episode."""
    if not local:
        return {}
    totals = dict(zip(local, all_reduce_sum(list(local.values()), dist), strict=True))
    episodes = totals.pop("agent/episodes", 0.0)
    return {name: value / episodes if episodes else 0.0 for name, value in totals.items()}


def completion_records(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completion records over every rank's completions of a batch: lengths of all and of those that
    ended (0 when none did), and the share cut at ``max_completion_length``."""
    terminated = lengths[truncated == 0]
    terminated = terminated if len(terminated) else torch.zeros(1, dtype=lengths.dtype)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": float(lengths.max()),
        "completions/min_length": float(lengths.min()),
        "completions/clipped_ratio": float(truncated.mean()),
        "completions/mean_terminated_length": float(terminated.mean()),
        "completions/min_terminated_length": float(terminated.min()),
        "completions/max_terminated_length": float(terminated.max()),
    }


def aligned_logps(rows: Sequence[tuple[int, list[float]]], width: int) -> torch.Tensor:
    """The engine's log-probabilities of each row's completion tokens (``(prompt length, logps)``), laid out
    as the trainer's are: at the position that predicts the token (``[rows, width]``, 0 elsewhere)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for index, (prompt, logps) in enumerate(rows):
        if logps:
            out[index, prompt - 1 : prompt - 1 + len(logps)] = torch.tensor(logps, dtype=torch.float32)
    return out


def training_micro_batches(
    prompt_ids: list[list[int]],
    completions: Completions,
    values: dict[str, torch.Tensor],
    micro: int,
    pad_id: int,
    mask_truncated: bool,
    join: bool = False,
) -> list[dict[str, Any]]:
    """Prompt + completion rows in micro-batches of ``micro``, completion tokens in the loss
    (``completion_mask``; those cut at the limit left out when ``mask_truncated``), each per-completion value
    sliced in (``IN_LOSS`` multiplies the mask instead), and the engine's log-probabilities laid out as the
    trainer's (``sampling_logps``) when it gave them. The tokens tools added (``Completions.tool_mask`` 0) are not in the loss. ``join``: each micro-batch
    also carries its rows joined without padding (``JOINED``), which the forward runs instead."""
    prompt_ids = completions.prompt_ids or prompt_ids
    out = []
    for start in range(0, len(prompt_ids), micro):
        part = range(start, min(start + micro, len(prompt_ids)))
        rows = [
            (
                prompt_ids[i] + completions.ids[i],
                [IGNORE_INDEX] * len(prompt_ids[i]) + model_labels(completions, i),
            )
            for i in part
        ]
        input_ids, labels, attention = pad_rows(rows, pad_id)
        mask = (target_labels({"labels": labels}) != IGNORE_INDEX).float()
        if mask_truncated:
            kept = torch.tensor([not completions.truncated[i] for i in part], dtype=torch.float32)
            mask = mask * kept[:, None]
        if IN_LOSS in values:  # completions the method leaves out of the loss (0)
            mask = mask * values[IN_LOSS][start : start + len(part), None].float()
        batch: dict[str, Any] = {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention,
            "completion_mask": mask,
            "num_target_tokens": int(mask.sum()),
            "num_input_tokens": int(attention.sum()),
            "num_samples": len(part),
            "num_attention_sq": sum(len(ids) ** 2 for ids, _ in rows),
        }
        for name, value in values.items():
            if name != IN_LOSS:
                batch[name] = value[start : start + len(part)]
        batch["target_rows"] = target_rows(batch)
        if join:
            batch[JOINED] = joined_rows(input_ids, attention)
        if completions.logps is not None:
            batch["sampling_logps"] = aligned_logps(
                [(len(prompt_ids[i]), completions.logps[i]) for i in part], input_ids.shape[1]
            )
        out.append(batch)
    return out


class CompletionsLog:
    """``completions.jsonl``: one JSON line per completion of a logged batch: the prompt (as the data holds
    it, and as the model saw it: the chat template, the tools' schemas, an environment's observation), the
    completion, its messages in an agent run, the method's fields and the row it came from."""

    @classmethod
    def of_run(cls, ctx: RunContext, tokenizer: Any) -> CompletionsLog:
        """The run's ``completions.jsonl`` (rank 0 writes it, with ``log_completions``)."""
        written = ctx.config.log_completions and ctx.dist.is_main
        return cls(MetricsFile(ctx.output_dir / "completions.jsonl", written), tokenizer)

    def __init__(self, file: MetricsFile, tokenizer: Any) -> None:
        self.file, self.tokenizer = file, tokenizer

    def write(self, generation: int, generated: GeneratedBatch, fields: list[dict[str, Any]]) -> None:
        completions = generated.completions
        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        seen = self.tokenizer.batch_decode(generated.prompt_ids, skip_special_tokens=False)
        for index, text in enumerate(texts):
            row = generated.rows[index]
            record = {
                "generation": generation,
                "epoch": generated.epoch,
                "batch": generated.batch,
                "prompt": prompt_of(row),
                "prompt_as_seen": seen[index],
                "completion": text,
                "truncated": completions.truncated[index],
                **({"messages": completions.messages[index]} if completions.messages else {}),
                **({"calls": completions.calls[index]} if completions.calls else {}),
                **fields[index],
                "origin": row.get(ORIGIN_KEY),
            }
            self.file.write(record)

    def close(self) -> None:
        self.file.close()


class EngineGeneration:
    """The run's engine with weights of its own (vLLM colocated or servers) for greedy generations outside the
    step feed (``training.steps.SideGeneration``): every rank
    calls :meth:`prepare` (the batches generated ahead waited for, the current weights pushed: a collective),
    then any rank may call :meth:`generate` (no collective)."""

    def __init__(self, feed: OnlineSteps, backend: EngineCopy) -> None:
        self.feed, self.backend = feed, backend

    def prepare(self, module: torch.nn.Module) -> None:
        self.feed.source.other_weights()
        if self.backend.stale:
            self.backend.push(module)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions of ``prompts`` (token ids), each up to ``max_new_tokens`` or a stop token."""
        return list(self.backend.sample(prompts, Sampling(max_new_tokens), None, False).ids)
