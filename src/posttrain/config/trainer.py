"""The top-level ``TrainerConfig``: every key of a run's YAML file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, SerializeAsAny, field_validator

from posttrain.config import moe, sequence_parallel
from posttrain.config.base import BaseConfig, ModeKeys, Problem
from posttrain.config.checkpoint import CheckpointConfig
from posttrain.config.data import DataConfig
from posttrain.config.deepspeed_block import deepspeed_problems
from posttrain.config.fp8 import frozen_model_problems
from posttrain.config.harness import HarnessConfig
from posttrain.config.human import HumanFloat, HumanInt, StepInterval, coerce_tree
from posttrain.config.logger import LoggerConfig
from posttrain.config.model import ModelConfig
from posttrain.config.optimizer import OptimizerConfig
from posttrain.config.scheduler import SchedulerConfig
from posttrain.config.tokenizer import TokenizerConfig
from posttrain.config.tracking import MetricsConfig, MLflowTrackingConfig, ProfilingConfig, TensorBoardConfig
from posttrain.config.wandb import WandBConfig


class TrainerConfig(BaseConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(("manual_gc_interval", "manual_gc_eval"), lambda c, root: c.manual_gc, "manual_gc: true"),
        ModeKeys(
            ("max_per_device_train_batch_size",),
            lambda c, root: c.total_train_batch_size is not None,
            "total_train_batch_size",
        ),
        ModeKeys(
            ("eval_iters", "eval_log_iter_interval"),
            lambda c, root: c.data.has_eval,
            "eval data (data.eval_sources or data.train_eval_split)",
        ),
        ModeKeys(
            ("mem_profiler_dir", "mem_profiler_max_entries"),
            lambda c, root: c.mem_profiler is not None,
            "mem_profiler: step or e2e",
        ),
    )
    _origins: dict[tuple[Any, ...], str] = PrivateAttr(default_factory=dict)
    _derived: set[tuple[Any, ...]] = PrivateAttr(default_factory=set)
    type: str = "sft"
    """Trainer (training method) type."""

    code: str = "train.py"
    """Python file with user components, relative to the config file. Loaded before validation when it
    exists; naming a file that does not exist is an error."""

    skip_validation: bool = False
    """Allow component types that the trainer does not declare as compatible."""

    model: SerializeAsAny[ModelConfig]
    """Model configuration."""

    tokenizer: SerializeAsAny[TokenizerConfig] = Field(default_factory=lambda: TokenizerConfig())
    """Tokenizer configuration."""

    data: SerializeAsAny[DataConfig]
    """Training and evaluation data configuration."""

    logger: LoggerConfig = Field(default_factory=lambda: LoggerConfig())
    """Logger configuration."""

    wandb: WandBConfig = Field(default_factory=lambda: WandBConfig())
    """Weights & Biases configuration."""

    tracking: MLflowTrackingConfig | None = None
    """MLflow tracking (SiloGen's ``tracking``). Null: off."""

    tensorboard: TensorBoardConfig = Field(default_factory=lambda: TensorBoardConfig())
    """TensorBoard event files."""

    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig())
    """What is measured besides loss and LR (timers, MFU's peak TFLOPS)."""

    profiling: ProfilingConfig = Field(default_factory=lambda: ProfilingConfig())
    """PyTorch profiler over a step range, and a Python profile of the main rank."""

    scheduler: SerializeAsAny[SchedulerConfig] = Field(default_factory=lambda: SchedulerConfig())
    """Learning-rate scheduler configuration."""

    optimizer: SerializeAsAny[OptimizerConfig] = Field(default_factory=lambda: OptimizerConfig())
    """Optimizer configuration."""

    deepspeed: dict[str, Any] = {}
    """DeepSpeed config. Keys you set win; the rest is filled in (batch sizes, ZeRO stage 2 defaults,
    bf16/fp16 from ``model.dtype``, gradient clipping 1.0). A partial ``zero_optimization`` block is merged
    with the defaults."""

    epochs: int = Field(default=1, ge=0)
    """Passes over the training data."""

    loss_log_interval: StepInterval = Field(default=1, ge=0)
    """Print a metrics line every N optimizer steps (0: never). The metrics file gets every step. A fraction
    below 1 is a share of the run's steps (0.1: every 10% of them), as Hugging Face reads ``logging_steps``."""

    train_log_iter_interval: Literal[0, 1] = 1
    """Write a line to ``train_log_metrics_path`` every step (1) or never (0)."""

    train_log_metrics_path: str = ""
    """JSON-lines file with one line of metrics per optimizer step. Empty:
    ``<logger.output_dir>/train-log-metrics.jsonl``."""

    gradient_accumulation_steps: HumanInt = Field(default=1, ge=1)
    """Micro-batches per optimizer step."""

    micro_batch_size: HumanInt = Field(default=1, ge=1)
    """Samples (or packed sequences) per micro-batch per rank."""

    total_train_batch_size: HumanInt | None = Field(default=None, ge=1)
    """The global batch in samples (SiloGen's batch-size config). When set, ``micro_batch_size`` and
    ``gradient_accumulation_steps`` are derived from it and the world size at the start of the run (the
    fewest accumulation steps whose micro-batch fits ``max_per_device_train_batch_size``); it must be a
    multiple of the world size."""

    max_per_device_train_batch_size: HumanInt | None = Field(default=None, ge=1)
    """With ``total_train_batch_size``: the largest micro-batch one device holds. Null: no limit."""

    rampup_batch_size: tuple[HumanInt, HumanInt, HumanInt] | None = None
    """Megatron's batch-size ramp-up ``[start, increment, samples]``: the global batch starts at ``start``
    and grows by ``increment`` at even intervals over the first ``samples`` samples until it reaches the
    configured global batch (by taking fewer micro-batches per step). Null: off."""

    sequence_parallel_size: int = Field(default=1, ge=1)
    """Ulysses sequence parallelism (DeepSpeed): each sample is split along the sequence over this many
    processes, which exchange attention heads so every process attends over the whole sequence. It must
    divide the world size; the data-parallel size (which sets the global batch, LR scaling and the
    sampler's shards) is world size / this. Needs ``sdpa`` or flash attention and attention heads
    divisible by it. 1: off."""

    expert_parallel_size: int = Field(default=1, ge=1)
    """Expert parallelism for mixture-of-experts models: each MoE layer's experts are split over this many
    processes (a contiguous block each) and tokens travel to their experts with all-to-all; DeepSpeed reduces
    expert gradients over the processes holding the same experts and everything else over all. Must divide
    the world size and the experts per layer; ZeRO stage 0, 1 or 2. Runs through the grouped implementation
    (``arctic_moe``). 1: every process holds every expert."""

    arctic_moe: bool | Literal["auto"] = False
    """Run MoE layers through posttrain's grouped expert-parallel implementation (the model's own fused
    experts computation, with the expert sharding and all-to-all of ``expert_parallel_size``). ``auto``: when
    the model is a mixture of experts; ``true`` on a dense model is an error. Implied by
    ``expert_parallel_size`` > 1."""

    enable_arctic_moe_custom_optimization: bool = False
    """ArcticTraining's custom CUDA all-to-all and grouped-GEMM kernels for MoE layers. posttrain does not
    ship them: ``true`` is refused (the grouped implementation uses PyTorch's own grouped matmul)."""

    enable_routing_replay: bool = False
    """Replaying recorded MoE routing in a later pass. Refused: posttrain has no pass to replay into (DPO's
    reference log-probabilities are computed once before training, and a checkpointed layer's recomputation
    routes exactly as its forward did)."""

    activation_checkpoint_cpu_offload: bool = False
    """Keep the activations saved at each checkpointed layer (its input hidden states) in CPU memory
    (pinned on a GPU) between forward and backward. Needs activation checkpointing (on by default). Worth
    it from about 64K tokens per GPU."""

    tiled_mlp_compute: bool = False
    """Compute gated MLPs (LLaMA, Qwen, Mistral style) in sequence tiles of about hidden-size tokens,
    recomputing each tile in backward: the MLP's intermediate activations never exist for the whole
    sequence. Other MLP shapes are refused at start."""

    tiled_loss_compute: bool | Literal["auto"] = "auto"
    """Compute the LM head and the loss a chunk of labelled positions at a time, so the
    ``[tokens x vocab]`` logits never exist at once (same loss and gradients as the plain path).
    ``auto``: for micro-batches of at least 8,192 tokens per process (models whose head is a plain linear
    layer); ``true``/``false``: always/never."""

    check_memory: bool = True
    """Before loading the model, plan the run's memory from the model's ``config.json`` (``posttrain
    preprocess`` prints the plan): stop (exit 2) when the host cannot hold the model states the config keeps
    there (offloaded optimizer and parameters, or everything on a CPU run), warn when a GPU's estimated
    peak is above its memory. ``false`` skips the plan."""

    seed: int = Field(default=42, ge=0)
    """Seed of Python's, NumPy's and torch's random generators (model init, dropout)."""

    checkpoint: list[SerializeAsAny[CheckpointConfig]] = []
    """Checkpoint engines; several may be used together."""

    train_iters: HumanInt = Field(default=0, ge=0)
    """Stop after this many optimizer steps (0: run all epochs). Schedulers are sized by it when set."""

    eval_interval: StepInterval = Field(default=0, ge=0, alias="eval_frequency")
    """Evaluate every N optimizer steps (0: never). Needs eval data and is needed by it. ArcticTraining's
    older name ``eval_frequency`` is accepted. A fraction below 1 is a share of the run's steps (0.2: every
    20% of them, rounded up), as Hugging Face reads ``eval_steps``."""

    eval_log_iter_interval: HumanInt = Field(default=1, ge=0)
    """Print every N-th evaluation's metrics line (0: never print; the metrics file still gets them)."""

    eval_iters: HumanInt = Field(default=0, ge=0, alias="max_evaluate_steps")
    """Evaluate on at most this many global batches: the first ``eval_iters x global batch size`` eval
    samples, whatever the world size (Megatron's ``eval_iters``, ERNIEKit's ``max_evaluate_steps``).
    0: the whole eval set."""

    eval_at_end: bool = True
    """Evaluate once more after the last training step (when eval data is configured)."""

    harness: HarnessConfig | None = None
    """lm-evaluation-harness tasks on the model being trained, every ``harness.interval`` steps and at the end,
    logged as ``eval/<task>/<metric>`` with their cost in ``time_harness`` (Axolotl's ``lm_eval_tasks``):
    ``{tasks: [reverse_digits], include_path: examples/harness, interval: 50, limit: 200}``. Null: none."""

    eval_on_start: bool = False
    """Evaluate before the first training step (logged as iter 0), so one run shows the held-out loss before
    and after training (Hugging Face Trainer's name). Not repeated when a run resumes."""

    skip_train: bool = False
    """Evaluate the model once and exit without training (Megatron's ``skip_train``); needs eval data."""

    exit_iteration: int = Field(default=0, ge=0)
    """Stop at this optimizer step even if data and epochs remain (0: off). Schedules are not resized."""

    exit_iteration_this_run: int = Field(default=0, ge=0)
    """Stop after this many optimizer steps of this process's run (0: off), counted from where it started."""

    exit_interval: HumanInt | None = Field(default=None, ge=1)
    """Stop (saving as for the kill switch) at the first optimizer step divisible by this (Megatron's
    ``exit_interval``). Null: off."""

    manual_gc: bool = False
    """Turn off Python's automatic garbage collector and collect at fixed points instead, so every rank
    pauses at the same step (Megatron's ``manual_gc``)."""

    manual_gc_interval: HumanInt = Field(default=0, ge=0)
    """With ``manual_gc``: collect every N optimizer steps (0: only around evaluations)."""

    manual_gc_eval: bool = True
    """With ``manual_gc``: collect before and after every evaluation."""

    min_iterations: HumanInt = Field(default=0, ge=0)
    """Repeat the training data until it is enough for at least this many optimizer steps."""

    overfit_first_batch: bool = False
    """Train on repetitions of the first batch only (a quick check that the model can learn)."""

    mem_profiler: Literal[None, "step", "e2e"] = None
    """Memory profiling. ``step``: one snapshot per optimizer step; ``e2e``: one for the whole run. On GPU,
    PyTorch's CUDA memory history (open the ``.pickle`` files at https://pytorch.org/memory_viz); on CPU, a
    memory timeline (process RSS per step) in ``memory-rank<N>.jsonl``. Written to ``mem_profiler_dir``."""

    mem_profiler_dir: str = ""
    """Where memory profiles go. Empty: ``<logger.output_dir>/mem-prof``."""

    mem_profiler_max_entries: HumanInt = Field(default=100_000, ge=1)
    """Most allocation events kept by the memory profiler."""

    exit_duration_in_mins: HumanFloat | None = Field(default=None, gt=0)
    """Stop cleanly (saving as for the kill switch) before this many minutes of training have passed
    (Megatron-Bridge's option). Null: no limit."""

    kill_switch_path: str = ""
    """Creating this file stops training cleanly after the current step. Empty:
    ``<logger.output_dir>/kill-switch`` (ArcticTraining's ``/tmp/at_kill_switch`` is shared by every job)."""

    @field_validator("deepspeed", mode="before")
    @classmethod
    def _human_deepspeed(cls, value: Any) -> Any:
        return coerce_tree(value) if isinstance(value, dict) else value

    @field_validator("tiled_loss_compute", mode="before")
    @classmethod
    def _auto_or_bool(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        words = {"true": True, "false": False}
        if isinstance(value, str) and value.lower() in words:
            return words[value.lower()]
        raise ValueError(f"{value!r} is not allowed; use auto, true or false")

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        return value if isinstance(value, list) else [value]

    def batch_problems(self, global_batch: int, made_of: str) -> Iterator[Problem]:
        """The method's checks of its global batch (``made_of``: how it is made, for the message). They run
        at validation when ``total_train_batch_size`` fixes the batch, and once the world size is known
        (``plan.resolve``: ``validate --world-size``, ``train`` before it starts processes, every rank before
        its model loads) otherwise. A method that needs whole groups in a batch (grpo) overrides it."""
        return iter(())

    def model_problems(self, facts: Any) -> Iterator[Problem]:
        """The method's checks that need the model's facts (``models.facts.ModelFacts``, read from its
        ``config.json`` before any weight loads) and may read other models' configs: run by ``posttrain
        validate`` for a local model (exit 2) and by every rank before its model loads. A method that trains
        against another model (distill's teacher) overrides it."""
        return iter(())

    def refuse_model_problems(self, facts: Any) -> None:
        """:meth:`model_problems`, every one in one error (exit 2)."""
        from posttrain.errors import UserError

        found = [f"{path}: {message}" for path, message in self.model_problems(facts)]
        if found:
            raise UserError("\n".join(found))

    @property
    def joins_documents(self) -> bool:
        """Whether the model sees rows of several documents (packed or padding-free), which then attend per
        document."""
        return self.data.padding_free or self.data.pack_samples

    @property
    def checks_model(self) -> bool:
        """Whether the method checks the model's facts (overrides :meth:`model_problems`)."""
        return type(self).model_problems is not TrainerConfig.model_problems

    def _batch_problems(self) -> Iterator[Problem]:
        explicit = self.model_fields_set
        packed = self.data.pack_samples
        if self.total_train_batch_size is not None:
            yield from self.batch_problems(self.total_train_batch_size, "total_train_batch_size")
            for key in ("micro_batch_size", "gradient_accumulation_steps"):
                if key in explicit:
                    yield Problem(key, "is derived from total_train_batch_size; set one or the other")
            if packed and self.max_per_device_train_batch_size != 1:
                yield Problem(
                    "max_per_device_train_batch_size",
                    "data.pack_samples=true needs 1 (a packed sequence already holds many samples)",
                )
        elif packed and self.micro_batch_size != 1:
            yield Problem(
                "micro_batch_size",
                f"data.pack_samples=true needs micro_batch_size: 1 (got {self.micro_batch_size}); "
                "a packed sequence already holds many samples",
            )
        if self.rampup_batch_size is not None:
            start, increment, samples = self.rampup_batch_size
            if start < 1 or increment < 1 or samples < 1:
                yield Problem("rampup_batch_size", f"{list(self.rampup_batch_size)}: all three must be >= 1")

    def _eval_problems(self) -> Iterator[Problem]:
        used = self.eval_at_end or self.eval_on_start or self.skip_train
        if self.data.has_eval and self.eval_interval == 0 and not used:
            yield Problem(
                "eval_interval",
                "eval data is configured but never used: set eval_interval > 0, eval_at_end: true or "
                "eval_on_start: true",
            )
        if self.eval_on_start and not self.data.has_eval:
            yield Problem("eval_on_start", "needs eval data: set data.eval_sources or data.train_eval_split")
        if self.eval_interval > 0 and not self.data.has_eval:
            yield Problem(
                "eval_interval",
                f"{self.eval_interval} needs eval data: set data.eval_sources or data.train_eval_split",
            )
        if self.skip_train and not self.data.has_eval:
            yield Problem(
                "skip_train", "evaluates only, so it needs data.eval_sources or data.train_eval_split"
            )

    def problems(self) -> Iterator[Problem]:
        yield from moe.config_problems(self)
        if self.activation_checkpoint_cpu_offload and self.model.disable_activation_checkpoint:
            yield Problem(
                "activation_checkpoint_cpu_offload",
                "offloads the activations that checkpointing keeps, so it needs "
                "model.disable_activation_checkpoint: false",
            )
        yield from sequence_parallel.config_problems(self)
        yield from self._eval_problems()
        yield from self._batch_problems()
        if sum(c.auto_resume for c in self.checkpoint) > 1:
            yield Problem("checkpoint", "at most one checkpoint engine may set auto_resume: true")
        yield from deepspeed_problems(
            self.deepspeed,
            {
                "micro_batch_size": self.micro_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "optimizer": self.optimizer.type,
            },
        )
        if self.scheduler.lr is not None and self.scheduler.lr != self.optimizer.lr:
            yield Problem(
                "scheduler.lr",
                f"{self.scheduler.lr} disagrees with optimizer.lr={self.optimizer.lr}; "
                "the learning rate belongs in optimizer.lr (scheduler.lr is deprecated)",
            )


class ReferenceTrainerConfig(TrainerConfig):
    """A method that compares the policy with a frozen reference scored once before training (the DPO
    family, KTO), and pairs or rows batched padded (no packing, no sequence parallelism yet)."""

    ref_model: ModelConfig | None = None
    """The frozen reference model. Null: the policy's initial weights. Its log-probabilities are computed
    once, before training, so it never takes memory or time during training and never gets an optimizer."""

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.ref_model is not None and self.ref_model.peft_config is not None:
            yield Problem("ref_model.peft_config", "the reference model is frozen; adapters belong on model")
        yield from frozen_model_problems(self.ref_model, "ref_model")
        if self.ref_model is not None and self.ref_model.save_name is not None:
            yield Problem("ref_model.save_name", "the reference model is never saved; remove it")
        if self.sequence_parallel_size > 1:
            yield Problem(
                "sequence_parallel_size",
                f"{self.sequence_parallel_size}: {self.type} does not support sequence parallelism yet (sft and "
                "causal do); set it to 1",
            )
