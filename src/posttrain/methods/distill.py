"""On-policy distillation (``type: distill``, TRL 1.16's ``DistillationTrainer``): the student samples
completions of the prompts (the shared online feed, ``rollout.feed``: transformers or vLLM, keyed draws), the
teacher scores every completion token, and the student is trained to match the teacher's next-token
distribution under the generalized Jensen-Shannon divergence (Agarwal et al. 2024, "On-Policy Distillation of
Language Models"), per completion token t, with s = the student's and q = the teacher's distribution at
temperature T (``logits / T``):

- ``beta = 0``: KL(q || s) = sum_v q_v (log q_v - log s_v), the forward KL;
- ``beta = 1``: KL(s || q), the reverse KL (TRL's default);
- otherwise, with the mixture m = (1 - beta) s + beta q:
  beta KL(q || m) + (1 - beta) KL(s || m).

The loss is the sum over the step's completion tokens divided by their number over every micro-batch and rank
(TRL's ``sum / num_items_in_batch``). Neither model's ``[tokens x vocabulary]`` logits exist whole: inside the
student's LM head (so ZeRO-3 gathers its weight there, for the forward and the backward) both heads project
a chunk of the completion positions at a time, recomputed in the backward (``chunked_divergence``). Logged:
the divergence (``loss``), the student's and the teacher's entropy (``entropy``, ``teacher_entropy``) and the
completions' lengths, as TRL names them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from posttrain.config.distill import DistillTrainerConfig
from posttrain.dist import all_gather_rows
from posttrain.errors import UserError
from posttrain.generation.keyed import completion_key, keyed_uniform
from posttrain.generation.transformers_engine import TransformersEngine
from posttrain.generation.types import Completions
from posttrain.logs import say
from posttrain.models.document_attention import follow_documents
from posttrain.models.token_logps import chunk_rows, forward_inputs, tileable_head, unwrap
from posttrain.rollout.feed import (
    GeneratedBatch,
    GenerationStats,
    OnlineMethod,
    OnlineSteps,
    completion_records,
)
from posttrain.rollout.sampler import stop_ids
from posttrain.tokenizers.chat_templates import end_of_turn_ids
from posttrain.tokenizers.padding import input_pad_id
from posttrain.training.extras import COUNT
from posttrain.vision.collate import prompt_images
from posttrain.vision.processor import is_vision_language, processor_of

#: the slot of a batch's key that draws whether it is on-policy (no completion has it)
ON_POLICY_DRAW = -1

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.context import RunContext
    from posttrain.plan import Batches, BatchSizes, DataPlan
    from posttrain.registry import MethodMemory
    from posttrain.training.engine import Engine


def divergence(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``[rows, vocab]`` logits: the generalized JSD of the module docstring (differentiable in the
    student's logits), the student's entropy and the teacher's (not differentiated), in float32."""
    s = torch.log_softmax(student.float() / temperature, dim=-1)
    t = torch.log_softmax(teacher.float() / temperature, dim=-1)
    if beta == 0.0:
        value = (t.exp() * (t - s)).sum(-1)
    elif beta == 1.0:
        value = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
        value = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    with torch.no_grad():
        entropy = -(s.exp() * s).sum(-1)
        teacher_entropy = -(t.exp() * t).sum(-1)
    return value, entropy, teacher_entropy


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    beta: float,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    student = F.linear(hidden, weight, bias)
    with torch.no_grad():
        teacher = F.linear(teacher_hidden.to(teacher_weight.dtype), teacher_weight, teacher_bias)
    return divergence(student, teacher, beta, temperature)


def chunked_divergence(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    teacher_hidden: torch.Tensor,
    teacher_head: tuple[torch.Tensor, torch.Tensor | None],
    beta: float,
    temperature: float,
    rows: int,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`divergence` over ``[positions, hidden]`` states through the student's head and the teacher's
    (``(weight, bias)``), ``rows`` positions at a time, each chunk's logits recomputed in the backward instead
    of kept; ``vocab``: the student's head rows compared (the first, those the teacher's head has too)."""
    values, entropies, teacher_entropies = [], [], []
    kept = slice(0, vocab)
    weight, bias = head.weight[kept], None if head.bias is None else head.bias[kept]
    for start in range(0, hidden.shape[0], rows):
        part = slice(start, start + rows)
        value, entropy, teacher_entropy = checkpoint(
            _chunk,
            hidden[part],
            weight,
            bias,
            teacher_hidden[part],
            teacher_head[0],
            teacher_head[1],
            beta,
            temperature,
            use_reentrant=False,
        )
        values.append(value)
        entropies.append(entropy)
        teacher_entropies.append(teacher_entropy)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return tuple(torch.cat(x) if x else empty for x in (values, entropies, teacher_entropies))  # type: ignore[return-value]


def _head(model: Any, who: str) -> torch.nn.Linear:
    head = tileable_head(model)
    if head is None:
        raise UserError(
            f"distill needs the {who}'s LM head to be a plain linear layer whose logits are used as they are "
            f"({type(unwrap(model)).__name__} has another, or LoRA on lm_head, or logit soft-capping)"
        )
    return head


class Teacher:
    """The frozen teacher on the student's device, after checking it shares the student's vocabulary: whole
    on every process, or under ZeRO-3 (when the student is) partitioned by a DeepSpeed engine of its own,
    its layers gathered as they run and its LM head gathered for each micro-batch's divergence."""

    def __init__(self, config: DistillTrainerConfig, ctx: RunContext, engine: Any, tokenizer: Any) -> None:
        from posttrain.models.reference import load_reference_model

        model = load_reference_model(config.teacher, ctx)
        follow_documents(unwrap(model), unwrap(engine.module), "teacher_model_name_or_path")
        if config.sequence_parallel_size > 1:  # the teacher's forward is split over the group too
            from posttrain.config.sequence_parallel import check_model
            from posttrain.models.facts import facts_from_hf_config

            teacher = unwrap(model).config
            check_model(
                config.sequence_parallel_size, facts_from_hf_config(teacher), teacher._attn_implementation
            )
        processor = processor_of(tokenizer)
        if processor is not None and not is_vision_language(unwrap(model).config):
            raise UserError(
                f"teacher_model_name_or_path: {config.teacher_model_name_or_path} is a text model and the student "
                "a vision-language model: the teacher would not see the prompts' images; distill from a "
                "vision-language teacher with the student's processor"
            )
        #: the head rows the divergence compares: those both heads have (a padded head's extra rows left out)
        self.vocab = shared_vocabulary(config, unwrap(engine.module), model, tokenizer)
        self.runner: Any = model.to(engine.device)
        if zero_stage(engine) == 3:
            import deepspeed

            settings: dict[str, Any] = {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            }
            for key in ("bf16", "fp16"):
                if key in engine.ds.config:
                    settings[key] = engine.ds.config[key]
            self.runner = deepspeed.initialize(model=model, config=settings)[0]
            say("teacher: partitioned by ZeRO-3 over the processes (a DeepSpeed engine of its own, frozen)")
        self.model = unwrap(self.runner)
        self.head = _head(self.model, "teacher")
        stops = stop_ids(tokenizer, self.model)
        self.backend = TransformersEngine(
            stops, input_pad_id(tokenizer, config.tokenizer.missing_pad_token_strategy), processor
        )

    @torch.no_grad()
    def hidden(self, batch: dict[str, Any]) -> torch.Tensor:
        """The teacher's last hidden states ``[rows, tokens, hidden]`` (its head returns them as they are)."""
        self.head.forward = lambda states: states  # type: ignore[method-assign]
        try:
            with forward_inputs(self.model, batch) as inputs:
                return self.runner(**inputs, use_cache=False).logits
        finally:
            del self.head.forward

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight and bias, whole: as they are, or under ZeRO-3 gathered copies held for one
        micro-batch (its divergence and the backward's recomputation read them)."""
        weight, bias = self.head.weight, self.head.bias
        rows = slice(0, self.vocab)
        if not hasattr(weight, "ds_id"):
            return weight[rows], None if bias is None else bias[rows]
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for p in (weight, bias) if p is not None]):
            return weight[rows].detach().clone(), None if bias is None else bias[rows].detach().clone()


def zero_stage(engine: Any) -> int:
    """The student engine's ZeRO stage (0 for an engine without DeepSpeed's)."""
    ds = getattr(engine, "ds", None)
    return int(ds.zero_optimization_stage()) if ds is not None else 0


def head_rows(model: torch.nn.Module) -> int:
    """The rows of a model's LM head (under ZeRO-3, of the whole weight, not this process's partition)."""
    weight = model.get_output_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def shared_vocabulary(
    config: DistillTrainerConfig, student: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any
) -> int:
    """The head rows the divergence compares: those both heads have (a head padded to another size is sliced
    to them, said in one line). The teacher's tokenizer was compared with the student's before any model
    loaded (``model_problems``); here it is compared with the tokenizer as the run built it (a chat-template
    preset may have added tokens the teacher never learnt)."""
    from transformers import AutoTokenizer

    from posttrain.config.distill import tokenizer_mismatch

    name = config.teacher_model_name_or_path
    theirs = AutoTokenizer.from_pretrained(name, trust_remote_code=config.teacher.trust_remote_code)
    mismatch = tokenizer_mismatch(tokenizer.get_vocab(), theirs.get_vocab())
    if mismatch:
        raise UserError(
            f"teacher_model_name_or_path: {name} has another tokenizer than the student's as this run built it "
            f"({mismatch}); a chat-template preset that adds tokens gives the student ids the teacher never "
            "learnt: keep the tokenizer's own template (tokenizer.chat_template: keep-original)"
        )
    rows = head_rows(student), head_rows(teacher)
    shared = min(rows)
    if shared < len(tokenizer):
        raise UserError(
            f"the LM heads have {rows[1]:,} (teacher) and {rows[0]:,} (student) rows, fewer than the "
            f"{len(tokenizer):,} tokens of their tokenizer: a head must score every token"
        )
    if rows[0] != rows[1]:
        say(
            f"distill: the teacher's LM head has {rows[1]:,} rows and the student's {rows[0]:,} (padded past the "
            f"tokenizer's {len(tokenizer):,} tokens): the divergence compares the first {shared:,}"
        )
    return shared


def on_policy(seed: int, epoch: int, batch: int, lmbda: float) -> bool:
    """Whether batch ``batch`` of ``epoch`` trains on the student's own completions: a uniform number drawn
    from (seed, epoch, batch) alone, below ``lmbda``."""
    if lmbda >= 1.0:
        return True
    key = torch.tensor([completion_key(seed, epoch, batch, ON_POLICY_DRAW)], dtype=torch.int64)
    return float(keyed_uniform(key, 0)[0]) < lmbda


def data_completions(rows: list[dict[str, Any]], tokenizer: Any, stops: list[int], limit: int) -> Completions:
    """Each row's ``completion`` column as the completion tokens the student would have produced: its text
    (an assistant message's content) tokenized without special tokens, then the end-of-turn token (or EOS)
    that ends a sampled completion; cut at ``limit`` tokens (truncated, as a sampled one would be)."""
    from posttrain.data.prompts import ORIGIN_KEY

    end = stops[0] if stops else tokenizer.eos_token_id
    turn = sorted(end_of_turn_ids(tokenizer))
    end = turn[0] if turn else end
    ids, truncated = [], []
    for row in rows:
        value = row.get("completion")
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            value = value[-1].get("content")
        if not isinstance(value, str):
            raise UserError(
                f"{row.get(ORIGIN_KEY, 'a row')}: lmbda < 1 without seq_kd trains part of the batches on the data's "
                "completions, and this row has no 'completion' (text or an assistant message); add the column, set "
                "seq_kd: true (the teacher's completions) or lmbda: 1"
            )
        tokens = [*tokenizer(value, add_special_tokens=False)["input_ids"], end]
        ids.append(tokens[:limit])
        truncated.append(len(tokens) > limit)
    return Completions(ids, truncated)


class DistillMethod(OnlineMethod):
    """distill's ``OnlineMethod``: completions' records for the step (lengths, as TRL logs them), nothing to
    add per completion."""

    wants_sampling_logps = False

    def __init__(self, ctx: RunContext, engine: Any, tokenizer: Any) -> None:
        self.ctx = ctx
        self.teacher = Teacher(ctx.config, ctx, engine, tokenizer)
        self.on_policy = True

    def describe(self) -> str:
        config = self.ctx.config
        mixed = (
            ""
            if config.lmbda == 1
            else f", lmbda {config.lmbda:g} (else the {'teacher' if config.seq_kd else 'data'}'s completions)"
        )
        return f"distill: teacher {config.teacher_model_name_or_path}, beta {config.beta:g}{mixed}"

    def completions_for(
        self,
        feed: OnlineSteps,
        epoch: int,
        batch: int,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        keys: list[int],
    ) -> Completions | None:
        """GKD's mixing: None (the student samples) for a share ``lmbda`` of batches, drawn per batch from the
        seed; otherwise the teacher's samples (``seq_kd``) or the data's completions."""
        config = self.ctx.config
        self.on_policy = on_policy(config.seed, epoch, batch, config.lmbda)
        if self.on_policy:
            return None
        if config.seq_kd:
            return self.teacher.backend.generate(
                self.teacher.model, prompt_ids, feed.sampling, keys, images=prompt_images(rows)
            )
        return data_completions(rows, feed.tokenizer, feed.stops, config.max_completion_length)

    def after_generation(self, feed: OnlineSteps, generated: GeneratedBatch) -> GenerationStats:
        completions = generated.completions
        mine = torch.tensor(
            [
                [n, float(cut)]
                for n, cut in zip(completions.model_lengths(), completions.truncated, strict=True)
            ],
            dtype=torch.float64,
        )
        everyone = all_gather_rows(mine, self.ctx.dist)
        records = completion_records(everyone[:, 0], everyone[:, 1])
        return GenerationStats(records={**records, "on_policy": float(self.on_policy)})

    def finish_batches(
        self, feed: OnlineSteps, generated: GeneratedBatch, micro_batches: list[dict[str, Any]]
    ) -> dict[str, Any]:
        for batch in micro_batches:
            batch["num_loss_units"] = int(batch["completion_mask"].sum())
        return {}


class DistillLoss:
    """The divergence of a micro-batch of generated completions (a sum over its completion tokens; see the module
    docstring), and for evaluation batches (prompts) the divergence on the student's greedy completions."""

    def __init__(self, config: DistillTrainerConfig, feed: OnlineSteps, teacher: Teacher) -> None:
        self.config, self.feed, self.teacher = config, feed, teacher

    def __call__(self, model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if "prompt_ids" in batch:
            return self.evaluate(model, batch)
        return self.divergence_sum(model, batch)

    def divergence_sum(
        self, model: Any, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config, teacher = self.config, self.teacher
        mask = batch["completion_mask"]
        rows = batch["target_rows"].to(mask.device)  # the feed's micro-batches carry them, found on the host
        teacher_hidden = teacher.hidden(batch)
        teacher_states = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, rows)
        head = _head(model, "student")
        teacher_head = teacher.head_weights()
        found: dict[str, torch.Tensor] = {}
        vocab, width = getattr(head.weight, "ds_shape", head.weight.shape)  # ZeRO-3: the whole weight's
        chunk = chunk_rows(int(vocab), int(width), max(int(rows.numel()), 1))

        def head_divergence(hidden: torch.Tensor) -> torch.Tensor:
            states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
            value, entropy, teacher_entropy = chunked_divergence(
                states,
                head,
                teacher_states,
                teacher_head,
                config.beta,
                config.temperature,
                chunk,
                teacher.vocab,
            )
            found.update(entropy=entropy, teacher_entropy=teacher_entropy)
            out = hidden.new_zeros(hidden.shape[0] * hidden.shape[1], dtype=torch.float32)
            return out.index_put((rows,), value).view(hidden.shape[:2])

        head.forward = head_divergence  # type: ignore[method-assign]
        try:
            with forward_inputs(model, batch) as inputs:
                per_position = model(**inputs, use_cache=False).logits
        finally:
            del head.forward
        kept = mask.reshape(-1).index_select(0, rows)
        tokens = kept.sum()
        metrics = {
            "entropy": (found["entropy"] * kept).sum(),
            "entropy" + COUNT: tokens,
            "teacher_entropy": (found["teacher_entropy"] * kept).sum(),
            "teacher_entropy" + COUNT: tokens,
        }
        return (per_position * mask).sum(), metrics

    @torch.no_grad()
    def evaluate(self, model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The student's greedy completions of the held-out prompts (through the run's backend), scored by the
        divergence: ``eval_loss`` is its sum over a completion, averaged over the prompts; ``eval_divergence``
        its mean per completion token."""
        from posttrain.data.collate import to_device

        feed = self.feed
        mask = batch["prompt_mask"].bool()
        prompts = [ids[keep].tolist() for ids, keep in zip(batch["prompt_ids"], mask, strict=True)]
        module = getattr(model, "module", model)
        completions = feed.complete(module, batch["rows"], prompts, feed.sampling, None)
        device = batch["prompt_ids"].device
        total, metrics, tokens = torch.zeros((), device=device), {}, torch.zeros((), device=device)
        pictures = prompt_images(batch["rows"])
        for micro in feed.micro_batches(
            prompts, completions, {}, pictures
        ):  # prompt + completion rows, as trained
            scored = to_device(micro, device)
            part, found = self.divergence_sum(model, scored)
            total, tokens = total + part, tokens + scored["completion_mask"].sum()
            metrics = {name: metrics.get(name, 0) + value for name, value in found.items()}
        return total, {**metrics, "divergence": total, "divergence" + COUNT: tokens}


def make_distill_loss(
    config: DistillTrainerConfig, tokenizer: PreTrainedTokenizerBase, steps: OnlineSteps
) -> DistillLoss:
    """distill's ``loss`` hook (``registry.LossBuilder``): the teacher and the evaluation's generation are the
    run's feed's (``distill_steps``)."""
    method = steps.method
    if not isinstance(method, DistillMethod):
        raise TypeError(f"distill's loss needs distill's step feed, not {type(method).__name__}")
    return DistillLoss(config, steps, method.teacher)


def distill_steps(
    ctx: RunContext, engine: Engine, batches: Batches, tokenizer: PreTrainedTokenizerBase
) -> OnlineSteps:
    """distill's ``steps`` hook (``registry.StepsBuilder``): one completion per prompt, sampled by the student
    from its current weights, one update per batch."""
    return OnlineSteps(ctx, engine, batches, tokenizer, DistillMethod(ctx, engine, tokenizer), group=1)


def distill_schedule(config: DistillTrainerConfig, samples: int, sizes: BatchSizes) -> tuple[int, int]:
    """distill's ``schedule`` hook (``registry.Schedule``): a batch is a global batch of prompts (one
    completion each), whole batches only; one update per batch."""
    batch = sizes.global_batch_size
    if samples < batch:
        raise UserError(
            f"{samples} prompts, fewer than the {batch} a batch takes; add prompts or lower the batch"
        )
    return samples // batch * batch, 1


def distill_memory(config: DistillTrainerConfig) -> MethodMemory:
    """distill's ``memory`` hook (``registry.MemoryHook``): training rows of prompt + completion tokens, the
    generation's KV cache, vLLM's share, the teacher's weights (whole on every process)."""
    return {
        "tokens_per_row_extra": config.max_completion_length,
        "generation_rows": True,
        "vllm_share": config.vllm_gpu_memory_utilization if config.use_vllm else 0.0,
        "teacher_models": [
            ("teacher_model_name_or_path", config.teacher_model_name_or_path, str(config.teacher.dtype))
        ],
    }


def distill_report(flight: DataPlan) -> list[str]:
    """distill's ``report`` hook (``registry.ReportHook``): generation ahead of training, and the tools."""
    from posttrain.rollout.agent import agent_report
    from posttrain.rollout.ahead import ahead_lines

    sizes = flight.sizes
    return [
        *ahead_lines(flight.config, sizes.micro_batch_size * sizes.gradient_accumulation_steps),
        *agent_report(flight),
    ]
