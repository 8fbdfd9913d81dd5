"""The loop's step feed for ``grpo``: each batch of prompts becomes completions, rewards, advantages and the
micro-batches of ``num_iterations`` optimizer steps.

For batch k of epoch e, the prompts are items ``k*P .. (k+1)*P - 1`` of the epoch's permutation of the prompt
data (``data.seed`` and the epoch, the same order for any process count), P = global batch / G. The batch's
completion slots are laid out prompt by prompt (slot s: prompt s // G, completion s % G) and every rank takes
its contiguous share: a group may straddle ranks, so rewards are gathered from every rank before the
advantages. Each completion is drawn from its own key (``generation.completion_key``), so the completions do
not depend on the process count or the batch's composition.

With ``num_iterations`` > 1 the batch, with the old policy's log-probabilities, is kept in the loop state of
this rank, which resumable checkpoints save, so a run killed between two updates of a batch resumes on it.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from posttrain.context import RunContext
from posttrain.data.grpo import ORIGIN_KEY, decode_row, prompt_of, reward_columns
from posttrain.data.sampler import shard_order
from posttrain.data.samples import IGNORE_INDEX, pad_rows, target_labels, target_rows
from posttrain.dist import all_gather_rows, all_reduce_sum
from posttrain.errors import UserError
from posttrain.methods.grpo.generation import (
    Completions,
    Sampling,
    TransformersBackend,
    completion_key,
    generation_eos,
)
from posttrain.methods.grpo.losses import (
    PolicyLoss,
    SamplingCorrection,
    advantages,
    loss_units,
    nanstd,
    reward_spread,
    sampling_records,
    sampling_statistics,
    sampling_weights,
)
from posttrain.methods.grpo.rewards import Reward, RewardContext, build_rewards, score_all
from posttrain.methods.grpo.vllm_backend import build_vllm_backend
from posttrain.models.token_logps import token_logps
from posttrain.tokenizers.chat_templates import end_of_turn_ids
from posttrain.tokenizers.padding import input_pad_id
from posttrain.tracking.metrics import MetricsFile

STATE_KEY = "grpo"


def sampling_of(config: Any) -> Sampling:
    return Sampling(
        config.max_completion_length,
        config.temperature,
        config.top_p,
        config.top_k or 0,
        config.repetition_penalty,
    )


def stop_ids(tokenizer: Any, module: torch.nn.Module | None = None) -> list[int]:
    """Where a completion ends: the chat template's end-of-turn tokens, the tokenizer's EOS and (given the
    model) its generation config's EOS ids, as TRL stops."""
    found = end_of_turn_ids(tokenizer) | ({tokenizer.eos_token_id} - {None})
    return sorted(found | (generation_eos(module) if module is not None else set()))


def completions_as_prompted(prompt: Any, text: str) -> Any:
    """TRL's convention: text for a text prompt, an assistant message for a chat prompt."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


class Scorer:
    """The rewards of a list of completions: every function, then their weighted sum (NaN counts as 0,
    TRL's ``nansum``)."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        self.rewards: list[Reward] = build_rewards(config.rewards, config.max_completion_length)
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        self.tokenizer = tokenizer
        self.context = RewardContext()  # trainer_state, log_extra, log_metric: TRL's extra arguments

    def __call__(self, rows: list[dict[str, Any]], completions: Completions) -> torch.Tensor:
        """``[completions, rewards]`` float64 (NaN where a function returned None)."""
        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        prompts = [prompt_of(row) for row in rows]
        columns: dict[str, list[Any]] = {}
        for index, row in enumerate(rows):
            for key, value in reward_columns(row).items():
                columns.setdefault(key, [None] * len(rows))[index] = value
        origins = [str(row.get(ORIGIN_KEY, "a row")) for row in rows]
        shown = [completions_as_prompted(p, t) for p, t in zip(prompts, texts, strict=True)]
        values = score_all(self.rewards, prompts, shown, completions.ids, columns, origins, self.context)
        return torch.tensor(values, dtype=torch.float64).T.reshape(len(rows), len(self.rewards))

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each completion's rewards (a None counts as 0, TRL's ``nansum``); NaN for a
        completion no reward function scored, which TRL leaves out of its group (advantage 0) and of the
        logged reward."""
        totals = (values * self.weights).nansum(dim=1)
        return totals.masked_fill(torch.isnan(values).all(dim=1), math.nan)


class Reference:
    """The frozen model the KL penalty compares with: the base model with the adapters off (PEFT), or a
    separate frozen copy (``ref_model``, or the policy's initial weights)."""

    def __init__(self, config: Any, ctx: RunContext, engine: Any, tokenizer: Any) -> None:
        self.engine, self.model = engine, None
        module = engine.module
        if config.ref_model is None and hasattr(module, "disable_adapter"):
            return
        from posttrain.models.embeddings import fit_embeddings
        from posttrain.models.reference import load_reference_model

        reference = load_reference_model(config.ref_model or config.model, ctx)
        fit_embeddings(reference, tokenizer)
        self.model = reference.to(engine.device)

    @torch.no_grad()
    def logps(self, batch: dict[str, Any], temperature: float) -> torch.Tensor:
        if self.model is not None:
            return token_logps(self.model, batch, False, temperature)[0]
        with self.engine.module.disable_adapter():
            return token_logps(self.engine, batch, False, temperature)[0]


class GenerationMetrics:
    """A step extra carrying each generation's numbers into the step records (they are the same on every rank:
    every rank gathered the whole batch's rewards) and the generation's share of the step time."""

    def __init__(self, rewards: list[Reward], backend: Any) -> None:
        self.rewards, self.backend = rewards, backend
        self.latest: dict[str, Any] = {}
        self.generation_time = 0.0
        self.yielded_at = time.perf_counter()
        self.closing: list[Any] = []  # the step feed's own closing (its log, its generation backend)

    def recording(self) -> Any:
        return nullcontext()

    def micro_batch(self, batch: dict[str, Any], micro_batches: int) -> tuple[None, dict[str, torch.Tensor]]:
        return None, {}

    def step_values(self, sums: dict[str, float], micro_batches: int, report: bool) -> dict[str, list[float]]:
        if hasattr(self.backend, "mark_stale"):
            self.backend.mark_stale()  # the update changed the weights: the engine's copy is old
        return {}

    def metrics(self, reduced: dict[str, list[float]], report: bool) -> dict[str, Any]:
        training = time.perf_counter() - self.yielded_at
        share = self.generation_time / (self.generation_time + training) if training > 0 else 0.0
        out = {**self.latest, "time_generation": self.generation_time, "generation_share": share}
        self.generation_time = 0.0  # the batch's next updates generate nothing
        return out

    def describe(self) -> str:
        names = ", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards)
        return f"grpo: rewards {names}"

    def close(self) -> None:
        for close in self.closing:
            close()


#: each run's step feed by its config object: the evaluation (the loss hook, which sees only the config)
#: reads the trainer state its reward context holds and generates through its backend (vLLM's engine too)
_RUN_FEEDS: weakref.WeakValueDictionary[int, GRPOSteps] = weakref.WeakValueDictionary()


def run_feed(config: Any) -> GRPOSteps | None:
    """The step feed of the run whose config this is, if it has one (an evaluation-only run has none)."""
    return _RUN_FEEDS.get(id(config))


def longest_prompt(data: Any) -> int:
    """The longest prompt in tokens, training and evaluation prompts alike (the engine's context)."""
    lengths = [int(view.lengths("input_ids").max()) for view in (data.train, data.eval) if len(view)]
    return max(lengths, default=1)


def build_backend(
    config: Any, module: torch.nn.Module, stops: list[int], longest: int, rows: int, dist: Any
) -> Any:
    """The vLLM backend of ``vllm_mode``: an engine in this process, or the run's server."""
    if config.vllm_mode == "server":
        from posttrain.methods.grpo.vllm_server import build_server_backend

        return build_server_backend(config, module, stops, longest, dist)
    return build_vllm_backend(config, module, stops, longest, rows, dist)


class GRPOSteps:
    """The step feed (``TrainerSpec.steps``) of ``grpo``; see the module docstring."""

    def __init__(self, ctx: RunContext, engine: Any, batches: Any, tokenizer: Any) -> None:
        config = ctx.config
        plan = batches.plan
        self.ctx, self.engine, self.config, self.tokenizer = ctx, engine, config, tokenizer
        self.prompts = plan.data.train
        self.step_plan = plan.step_plan
        self.total_steps = plan.total_steps
        sizes = plan.sizes
        self.group = config.num_generations
        self.per_batch = sizes.global_batch_size // self.group  # prompts
        self.micro = sizes.micro_batch_size
        self.mine = sizes.micro_batch_size * sizes.gradient_accumulation_steps  # completions on this rank
        self.updates = config.num_iterations
        self.sampling = sampling_of(config)
        self.pad_id = input_pad_id(tokenizer, config.tokenizer.missing_pad_token_strategy)
        stops = stop_ids(tokenizer, engine.module)
        self.backend: Any = (
            build_backend(config, engine.module, stops, longest_prompt(plan.data), self.mine, ctx.dist)
            if config.use_vllm
            else TransformersBackend(stops, self.pad_id)
        )
        self.correction = sampling_correction_of(config)
        self.scorer = Scorer(config, tokenizer)
        self.counters: dict[str, float] = {}  # the loop state's (steps() takes them from it)
        self.scorer.context.trainer_state = self._trainer_state(None, 0, 0, 1)  # before the first generation
        _RUN_FEEDS[id(config)] = self
        self.reference = Reference(config, ctx, engine, tokenizer) if config.beta > 0 else None
        self.params = policy_loss(config)
        self.metrics = GenerationMetrics(self.scorer.rewards, self.backend)
        self.extras = [self.metrics]
        self.log = MetricsFile(
            ctx.output_dir / "completions.jsonl", config.log_completions and ctx.dist.is_main
        )
        self.metrics.closing.append(self.close)

    # ------------------------------------------------------------------------------------------ the loop

    def steps(self, state: Any) -> Iterator[list[dict[str, Any]]]:
        epoch = state.epoch
        batches = len(self.step_plan[epoch]) // self.updates
        order = shard_order(len(self.prompts), 1, 0, self.config.data.seed, epoch)
        first, done = divmod(state.epoch_step, self.updates)
        self.counters = state.counters  # run-long totals, saved with resumable checkpoints
        for batch in range(first, batches):
            self.scorer.context.trainer_state = self._trainer_state(state, epoch, batch, batches)
            micro_batches = self._resumed(state, done) if done else self._generate(epoch, batch, order)
            if self.updates > 1:  # what the batch's next updates need after a resume
                state.rank_state[STATE_KEY] = {
                    "epoch": epoch,
                    "batch": batch,
                    "micro_batches": micro_batches,
                    "metrics": dict(self.metrics.latest),
                }
            for _ in range(done, self.updates):
                self.metrics.yielded_at = time.perf_counter()
                yield micro_batches
            done = 0
        state.rank_state.pop(STATE_KEY, None)

    def _resumed(self, state: Any, done: int) -> list[dict[str, Any]]:
        saved = state.rank_state.get(STATE_KEY)
        if saved is None or (saved["epoch"], saved["batch"]) != (
            state.epoch,
            state.epoch_step // self.updates,
        ):
            raise UserError(
                f"resuming after update {done} of the {self.updates} (num_iterations) of a generated batch, whose "
                "completions this rank's checkpoint does not hold (it was written by another number of "
                "processes); resume with the process count that wrote it, or from a checkpoint at a batch boundary"
            )
        self.metrics.latest = dict(saved["metrics"])
        return saved["micro_batches"]

    def _trainer_state(self, state: Any, epoch: int, batch: int, batches: int) -> Any:
        """What TRL hands reward functions as ``trainer_state``: transformers' ``TrainerState`` at this
        generation (the optimizer steps done, the run's total, the epoch as a fraction)."""
        from transformers import TrainerState

        config, dist = self.config, self.ctx.dist
        return TrainerState(
            epoch=epoch + batch / max(batches, 1),
            global_step=state.step if state is not None else 0,
            max_steps=self.total_steps,
            num_train_epochs=config.epochs,
            logging_steps=config.loss_log_interval,
            train_batch_size=config.micro_batch_size,
            is_local_process_zero=dist.local_rank == 0,
            is_world_process_zero=dist.is_main,
        )

    def _logged_metrics(self, logged: dict[str, list[float]]) -> dict[str, float]:
        """The rewards' ``log_metric`` values: each name's mean over every call on every rank (names gathered
        from all ranks, so that a name logged on one rank only still reduces)."""
        dist = self.ctx.dist
        names = set(logged)
        if dist.world_size > 1:
            import torch.distributed as torch_dist

            everyone: list[Any] = [None] * dist.world_size
            torch_dist.all_gather_object(everyone, sorted(names))
            names = {name for found in everyone for name in found}
        names_in_order = sorted(names)
        local = [x for n in names_in_order for x in (sum(logged.get(n, [])), float(len(logged.get(n, []))))]
        totals = all_reduce_sum(local, dist) if local else []
        return {
            name: totals[2 * i] / totals[2 * i + 1] if totals[2 * i + 1] else math.nan
            for i, name in enumerate(names_in_order)
        }

    # ----------------------------------------------------------------------------------------- a rollout

    def _generate(self, epoch: int, batch: int, order: np.ndarray) -> list[dict[str, Any]]:
        """Completions for this rank's slots of the batch, their rewards and advantages (from every rank's
        rewards), and the micro-batches of its updates."""
        dist, group = self.ctx.dist, self.group
        first = dist.rank * self.mine
        slots = range(first, first + self.mine)
        positions = order[batch * self.per_batch : (batch + 1) * self.per_batch]
        items = {s // group: self.prompts[int(positions[s // group])] for s in slots}
        rows = {p: decode_row(item) for p, item in items.items()}
        prompt_ids = [np.asarray(items[s // group]["input_ids"]).tolist() for s in slots]
        keys = [completion_key(self.config.seed, epoch, batch, s // group, s % group) for s in slots]
        started = time.perf_counter()
        logprobs = self.correction is not None
        completions = self.backend.generate(self.engine.module, prompt_ids, self.sampling, keys, logprobs)
        self.metrics.generation_time = time.perf_counter() - started
        values = self.scorer([rows[s // group] for s in slots], completions)
        extra, logged = self.scorer.context.take()
        lengths = torch.tensor([len(c) for c in completions.ids], dtype=torch.float64)
        truncated = torch.tensor(completions.truncated, dtype=torch.float64)
        prompted = torch.tensor([len(p) for p in prompt_ids], dtype=torch.float64)
        mine = torch.cat([values, prompted[:, None], lengths[:, None], truncated[:, None]], dim=1)
        everyone = all_gather_rows(mine, dist)  # [batch completions, rewards + 3], slot order
        rewards = everyone[:, : values.shape[1]]
        totals = self.scorer.total(rewards)
        advantage = advantages(totals, group, self.config.advantage, self.config.scale_rewards)
        names = [reward.name for reward in self.scorer.rewards]
        every_length, every_cut, scale = everyone[:, -2], everyone[:, -1], self.config.scale_rewards
        self.metrics.latest = rollout_records(rewards, totals, every_length, every_cut, names, group, scale)
        self.metrics.latest.update(self._logged_metrics(logged))
        # TRL's num_tokens: prompt and completion tokens of every generated batch so far, all ranks
        seen = self.counters.get("num_tokens", 0.0) + float(everyone[:, -3].sum() + everyone[:, -2].sum())
        self.counters["num_tokens"] = seen
        self.metrics.latest["num_tokens"] = seen
        own = advantage[first : first + self.mine]
        own_rows = [rows[s // group] for s in slots]
        self._log(epoch, batch, own_rows, completions, values, totals, own, first, extra)
        micro_batches = self._micro_batches(prompt_ids, completions, own)
        statistics = self._add_log_probabilities(micro_batches)
        if statistics is not None:
            self.metrics.latest.update(sampling_records(all_gather_rows(statistics[None], dist)))
        return micro_batches

    def _micro_batches(
        self, prompt_ids: list[list[int]], completions: Completions, advantage: torch.Tensor
    ) -> list[dict[str, Any]]:
        out = []
        for start in range(0, len(prompt_ids), self.micro):
            part = range(start, min(start + self.micro, len(prompt_ids)))
            rows = [
                (prompt_ids[i] + completions.ids[i], [IGNORE_INDEX] * len(prompt_ids[i]) + completions.ids[i])
                for i in part
            ]
            input_ids, labels, attention = pad_rows(rows, self.pad_id)
            mask = (target_labels({"labels": labels}) != IGNORE_INDEX).float()
            if self.config.mask_truncated_completions:
                kept = torch.tensor([not completions.truncated[i] for i in part], dtype=torch.float32)
                mask = mask * kept[:, None]
            batch: dict[str, Any] = {
                "input_ids": input_ids,
                "labels": labels,
                "attention_mask": attention,
                "completion_mask": mask,
                "advantages": advantage[start : start + len(part)].float(),
                "num_loss_units": loss_units(self.params, mask),
                "num_target_tokens": int(mask.sum()),
                "num_input_tokens": int(attention.sum()),
                "num_samples": len(part),
                "num_attention_sq": sum(len(ids) ** 2 for ids, _ in rows),
            }
            batch["target_rows"] = target_rows(batch)
            if completions.logps is not None:
                batch["sampling_logps"] = aligned_logps(
                    [(len(prompt_ids[i]), completions.logps[i]) for i in part], input_ids.shape[1]
                )
            out.append(batch)
        return out

    @torch.no_grad()
    def _add_log_probabilities(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor | None:
        """The old policy's log-probabilities (for the ratio of later updates, and always under the
        engine-mismatch correction, as TRL), the reference's, and the correction's weights; returns this
        rank's correction statistics (``losses.sampling_statistics``) when it applies."""
        correction = self.correction
        if self.updates == 1 and self.reference is None and correction is None:
            return None
        from posttrain.data.collate import to_device

        tiled, temperature = self.config.tiled_loss_compute, self.config.temperature
        olds, samplings, masks = [], [], []
        for batch in micro_batches:
            sampling = batch.pop("sampling_logps", None)
            on_device = to_device(batch, self.engine.device)
            if self.updates > 1 or correction is not None:
                batch["old_logps"] = token_logps(self.engine, on_device, tiled, temperature)[0].cpu()
            if self.reference is not None:
                batch["ref_logps"] = self.reference.logps(on_device, temperature).cpu()
            if correction is not None and sampling is not None:
                mask = batch["completion_mask"]
                batch["sampling_weight"] = sampling_weights(correction, batch["old_logps"], sampling, mask)
                olds.append(batch["old_logps"].flatten())
                samplings.append(sampling.flatten())
                masks.append(mask.flatten())
        if correction is None or not olds:
            return None
        weights = torch.cat([b["sampling_weight"].flatten() for b in micro_batches if "sampling_weight" in b])
        old, sampled, mask = (torch.cat(parts).view(1, -1) for parts in (olds, samplings, masks))
        return sampling_statistics(correction, old, sampled, mask, weights.view(1, -1))

    def _log(
        self,
        epoch: int,
        batch: int,
        rows: list[dict[str, Any]],
        completions: Completions,
        values: torch.Tensor,
        totals: torch.Tensor,
        advantage: torch.Tensor,
        first: int,
        extra: dict[str, list[Any]],
    ) -> None:
        """Rank 0's completions of every ``completions_log_interval``-th generated batch of the run, one JSON
        line each, with the columns the rewards added (``log_extra``, one value per completion)."""
        generation = epoch * (len(self.step_plan[0]) // self.updates) + batch
        if not self.config.log_completions or generation % self.config.completions_log_interval:
            return
        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        own_totals = totals[first : first + len(texts)]
        names = [r.name for r in self.scorer.rewards]
        for index, text in enumerate(texts):
            row = rows[index]
            record = {
                "generation": generation,
                "epoch": epoch,
                "batch": batch,
                "prompt": prompt_of(row),
                "completion": text,
                "truncated": completions.truncated[index],
                "reward": float(own_totals[index]),
                "rewards": {n: _plain(float(values[index, i])) for i, n in enumerate(names)},
                "advantage": float(advantage[index]),
                "origin": row.get(ORIGIN_KEY),
            }
            for column, logged in extra.items():  # a built-in field keeps its name; the reward's is prefixed
                key = column if column not in record else f"extra/{column}"
                record[key] = _json_value(logged[index]) if index < len(logged) else None
            self.log.write(record)

    def close(self) -> None:
        self.backend.close()
        self.log.close()


def _plain(value: float) -> float | None:
    return None if math.isnan(value) else value


def _json_value(value: Any) -> Any:
    """A value a reward logged, as JSON holds it: numbers (NaN as null), text, bools, lists; others as text."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float):
        return _plain(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return str(value)


def aligned_logps(rows: list[tuple[int, list[float]]], width: int) -> torch.Tensor:
    """The engine's log-probabilities of each row's completion tokens (``(prompt length, logps)``), laid out
    as the trainer's are: at the position that predicts the token (``[rows, width]``, 0 elsewhere)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for index, (prompt, logps) in enumerate(rows):
        if logps:
            out[index, prompt - 1 : prompt - 1 + len(logps)] = torch.tensor(logps, dtype=torch.float32)
    return out


def sampling_correction_of(config: Any) -> SamplingCorrection | None:
    """TRL's vLLM importance-sampling correction, when the run generates with vLLM and keeps it on."""
    if not (config.use_vllm and config.vllm_importance_sampling_correction):
        return None
    return SamplingCorrection(
        config.vllm_importance_sampling_mode,
        config.vllm_importance_sampling_clip_min,
        config.vllm_importance_sampling_clip_max,
    )


def policy_loss(config: Any) -> PolicyLoss:
    return PolicyLoss(
        loss_type=config.loss_type,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.clip_high,
        sequence_ratio=config.importance_sampling_level == "sequence",
        max_completion_length=config.max_completion_length,
        bias_correction_kl=config.use_bias_correction_kl,
    )


def rollout_records(
    rewards: torch.Tensor,
    totals: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    names: list[str],
    group: int,
    scale: str,
) -> dict[str, float]:
    """A rollout's records, as TRL 1.16 logs them, from every rank's completions (``rewards``: ``[completions,
    functions]``, NaN where a function returned None; ``totals``: their weighted sums, NaN where none scored):
    ``reward`` and ``reward_std`` over the scored completions of the whole batch, ``frac_reward_zero_std`` over
    completions from the spread their advantage is scaled by, the lengths of all and of the terminated
    completions (0 when none ended), each function's mean and std over the completions it scored;
    ``reward_std_group``: the mean of the groups' standard deviations (what ``reward_std`` meant in older
    TRL)."""
    spread = reward_spread(totals, group, scale)
    terminated = lengths[truncated == 0]
    terminated = terminated if len(terminated) else torch.zeros(1, dtype=lengths.dtype)
    out = {
        "reward": float(torch.nanmean(totals)),
        "reward_std": float(nanstd(totals)),
        "reward_std_group": float(torch.nanmean(nanstd(totals.view(-1, group), dim=1))),
        "frac_reward_zero_std": float(torch.isclose(spread, torch.zeros_like(spread)).double().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": float(lengths.max()),
        "completions/min_length": float(lengths.min()),
        "completions/clipped_ratio": float(truncated.mean()),
        "completions/mean_terminated_length": float(terminated.mean()),
        "completions/min_terminated_length": float(terminated.min()),
        "completions/max_terminated_length": float(terminated.max()),
    }
    for index, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(torch.nanmean(rewards[:, index]))
        out[f"rewards/{name}/std"] = float(nanstd(rewards[:, index]))
    return out
