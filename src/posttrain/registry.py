"""Explicit component registries.

Every pluggable component (trainer, model factory, tokenizer factory, data source, data factory, optimizer,
scheduler, checkpoint engine) is registered by name in one of the registries below. ``type:`` keys in a config
are looked up here, and user code loaded through ``code:`` registers new components with the same API::

    from posttrain.registry import DATA_SOURCES

    @DATA_SOURCES.register("my-source", config=MySourceConfig)
    class MySource: ...
"""

from __future__ import annotations

import difflib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypedDict, TypeVar

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from posttrain.checkpoint.base import CheckpointEngine
    from posttrain.config.trainer import TrainerConfig
    from posttrain.context import RunContext
    from posttrain.data.build import DataFactory, Datasets
    from posttrain.data.sources import Row, RowReader
    from posttrain.models.facts import ModelFacts
    from posttrain.plan import Batches, BatchSizes, DataPlan
    from posttrain.training.engine import Engine
    from posttrain.training.extras import StepExtra
    from posttrain.training.steps import StepFeed

T = TypeVar("T")


# ------------------------------------------------------------------ what each kind of component looks like


class ModelFactory(ABC):
    """Loads a model and reports its facts; nothing more. Every transform the run applies (checkpointing,
    adapters, memory features, attention kernel, parallelism, compile) is the model stage's (``MODEL_TRANSFORMS``), so a model
    from any factory gets all of them."""

    def facts(self, config: Any) -> ModelFacts | None:
        """What the run needs to know about the model (hidden size, heads, MoE layout...) before any weight
        is read, e.g. from its ``config.json``: ZeRO-3 creates the model partitioned only when the DeepSpeed
        config exists before loading. None: only the loaded model can tell."""
        return None

    @abstractmethod
    def __call__(self, config: Any, ctx: RunContext) -> torch.nn.Module:
        """``(model config, run context) -> the loaded model`` (on the CPU; the engine places it)."""


class LoaderFunction(ModelFactory):
    """A plain function registered as a model factory (user code): it loads; facts come from its model."""

    def __init__(self, load: Callable[[Any, RunContext], torch.nn.Module]) -> None:
        self.load = load

    def __call__(self, config: Any, ctx: RunContext) -> torch.nn.Module:
        return self.load(config, ctx)


def as_model_factory(obj: Any) -> ModelFactory:
    return obj if isinstance(obj, ModelFactory) else LoaderFunction(obj)


class TokenizerFactory(Protocol):
    """``(tokenizer config, run context) -> a Hugging Face tokenizer`` (chat template and pad token set)."""

    def __call__(self, config: Any, ctx: RunContext) -> Any: ...


class DataSource(Protocol):
    """``(source config, run context) -> a row reader`` (or a plain list of rows, for small user sources)."""

    def __call__(self, config: Any, ctx: RunContext) -> RowReader | list[Row]: ...


class OptimizerFactory(Protocol):
    """``(optimizer config, model, run context) -> the optimizer`` over the trainable parameters."""

    def __call__(self, config: Any, model: torch.nn.Module, ctx: RunContext) -> torch.optim.Optimizer: ...


class SchedulerFactory(Protocol):
    """``(scheduler config, optimizer, total optimizer steps, run context) -> an LR scheduler``."""

    def __call__(
        self, config: Any, optimizer: torch.optim.Optimizer, total_steps: int, ctx: RunContext
    ) -> torch.optim.lr_scheduler.LRScheduler: ...


class ModelTransform(Protocol):
    """One transform of the model stage: ``(model, run config, model facts, tokenizer) -> the model`` (changed
    in place, or wrapped). A step whose feature the config does not ask for returns the model untouched."""

    def __call__(
        self, model: torch.nn.Module, config: Any, facts: ModelFacts, tokenizer: Any
    ) -> torch.nn.Module: ...


class StepExtraFactory(Protocol):
    """``(the training module, model facts, run config) -> a loop extra`` (``posttrain.training.extras.StepExtra``: a
    loss term and metrics added to every training step), or None when it does not apply to this run."""

    def __call__(self, module: torch.nn.Module, facts: ModelFacts, config: Any) -> StepExtra | None: ...


class GenerationEngineFactory(Protocol):
    """An online run's generation engine from the run's config and ``generation.types.EngineInputs`` (the
    training module, stop ids, the prompts' sizes, the process group...): a ``generation.types.
    GenerationEngine``. Picked by ``generation_engine`` (default: from ``use_vllm`` and ``vllm_mode``)."""

    def __call__(self, config: Any, inputs: Any) -> Any: ...


class CheckpointEngineFactory(Protocol):
    """``(checkpoint config, run context, tokenizer) -> a checkpoint engine`` (a ``CheckpointEngine`` class)."""

    def __call__(self, config: Any, ctx: RunContext, tokenizer: Any) -> CheckpointEngine: ...


_builtins_loaded = False
_loading_builtins = False


def load_builtins() -> None:
    """Register the built-in components (``posttrain.builtins`` lists them) before the first look-up of any
    registry: every entry point (the CLI, ``load_config``, ``run``, the schema, a test run alone) finds them,
    and nothing below the registry imports the components' modules itself."""
    global _builtins_loaded, _loading_builtins
    if _builtins_loaded:
        return
    _builtins_loaded = _loading_builtins = True
    try:
        from posttrain.builtins import register_builtins

        register_builtins()
    finally:
        _loading_builtins = False


class UnknownComponentError(KeyError):
    """A ``type:`` name that no registry entry matches."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        hint = difflib.get_close_matches(name, known, n=1)
        did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
        super().__init__(f"unknown {kind} type {name!r}{did_you_mean} (registered: {', '.join(known)})")

    def __str__(self) -> str:
        return str(self.args[0])


def load_component(ref: Any) -> Any:
    """A component named by its place, ``"package.module:attribute"``, imported on first use; anything else
    as it is. The built-ins are registered this way (``posttrain.builtins``), so that validating a config,
    which needs only their config classes, imports neither torch nor transformers."""
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


class Entry(Generic[T]):
    """One registered component: its name, the object itself (``obj``, imported on first use when it was
    registered by its place) and the pydantic config class it takes."""

    def __init__(
        self,
        name: str,
        registered: Any,
        config: type,
        adapt: Callable[[Any], T] | None = None,
        replaced: bool = False,
    ) -> None:
        self.name = name
        self.registered = registered  # the object, or its "module:attribute" place
        self.config = config
        self.replaced = replaced  # registered with replace=True
        self._adapt = adapt
        self._obj: T | None = None

    @property
    def obj(self) -> T:
        if self._obj is None:
            found = load_component(self.registered)
            self._obj = self._adapt(found) if self._adapt else found
        return self._obj


class Registry(Generic[T]):
    """A name -> component table for one kind of component."""

    def __init__(self, kind: str, adapt: Callable[[Any], T] | None = None) -> None:
        self.kind = kind
        self._adapt = adapt  # turns what is registered into the registry's component type
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, *, config: type, replace: bool = False) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name`` with its config class.

        Registering a taken name is an error unless ``replace=True``, so two plugins cannot silently shadow
        each other.
        """

        def decorator(obj: T) -> T:
            known = self._entries.get(name)
            if known is not None and known.registered is not obj:
                if _loading_builtins and known.replaced:
                    return obj  # a user's replacement registered before the built-ins were loaded wins
                if not replace:
                    raise ValueError(f"{self.kind} type {name!r} is already registered; pass replace=True")
            self._entries[name] = Entry(name, obj, config, self._adapt, replace)
            return obj

        return decorator

    def add(self, name: str, obj: T | str, *, config: type, replace: bool = False) -> T | str:
        """Non-decorator form of :meth:`register`; ``obj`` may be the component's place,
        ``"package.module:attribute"``, imported when the component is first used."""
        return self.register(name, config=config, replace=replace)(obj)

    def get(self, name: str) -> Entry[T]:
        load_builtins()
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownComponentError(self.kind, name, self.names()) from None

    def __contains__(self, name: object) -> bool:
        load_builtins()
        return name in self._entries

    def names(self) -> list[str]:
        load_builtins()
        return sorted(self._entries)


class OrderedTable(Generic[T]):
    """Named parts that run one after another in a fixed order (the model stage's transforms, the step
    extras). The built-ins come in the order ``posttrain.builtins`` lists them; a part added later (a user's,
    from ``code:``) goes last, or ``before``/``after`` a part named. Parts may be places
    (``"package.module:attribute"``), imported on first use."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._parts: list[tuple[str, Any]] = []

    def add(self, name: str, part: T | str, *, before: str | None = None, after: str | None = None) -> None:
        if before is not None and after is not None:
            raise ValueError(f"{self.kind} {name!r}: give before or after, not both")
        if not _loading_builtins:
            load_builtins()  # so that a user's part is placed among the built-ins, not before them
        if name in self.names(load=False):
            raise ValueError(f"{self.kind} {name!r} is already registered")
        anchor = before or after
        if anchor is None:
            self._parts.append((name, part))
            return
        names = self.names(load=False)
        if anchor not in names:
            hint = difflib.get_close_matches(anchor, names, n=1)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(
                f"{self.kind} {name!r}: no part named {anchor!r}{did_you_mean} ({', '.join(names)})"
            )
        self._parts.insert(names.index(anchor) + (after is not None), (name, part))

    def register(self, name: str, *, before: str | None = None, after: str | None = None) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def decorator(part: T) -> T:
            self.add(name, part, before=before, after=after)
            return part

        return decorator

    def names(self, load: bool = True) -> list[str]:
        if load:
            load_builtins()
        return [name for name, _ in self._parts]

    def parts(self) -> list[tuple[str, T]]:
        """Every part in order, imported."""
        load_builtins()
        return [(name, load_component(part)) for name, part in self._parts]


# ---------------------------------------------------------------- a method's hooks (``TrainerSpec``'s parts)

#: a micro-batch as a collator hands it to the loop (``data.collate.Batch``): the model's input tensors, the
#: host's counts (``num_loss_units``...), and a method's own columns (DPO's reference log-probabilities...)
MicroBatch = Mapping[str, object]


class LossFunction(Protocol):
    """``(model, micro-batch on the device) -> (loss, metrics)``: the loss *summed* over the micro-batch's loss
    units (the loop divides by the units of the whole step, all ranks), and metric sums divided the same way,
    or by their own ``name:count`` entry (``training.extras.COUNT``). ``model`` is the training engine (or,
    for a reference pass, a bare module): called like the model."""

    def __call__(
        self, model: Engine | torch.nn.Module, batch: MicroBatch
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]: ...


class LossBuilder(Protocol):
    """``TrainerSpec.loss``: ``(validated run config, tokenizer, the run's step feed) -> the loss function``.
    The feed is what ``TrainerSpec.steps`` built: an online method's loss evaluates through it (its
    generation engine, its scorer or teacher); an offline method's ignores it."""

    def __call__(
        self, config: TrainerConfig, tokenizer: PreTrainedTokenizerBase, steps: StepFeed
    ) -> LossFunction: ...


class Collate(Protocol):
    """A collator: the samples of a micro-batch (their token columns as the store holds them) -> a
    micro-batch of tensors with the host's counts."""

    def __call__(self, samples: Sequence[Mapping[str, object]]) -> MicroBatch: ...


class CollatorBuilder(Protocol):
    """``TrainerSpec.collator``: ``(the pad id) -> the method's collator`` (none: the padding collator)."""

    def __call__(self, pad_id: int) -> Collate: ...


class Prepare(Protocol):
    """``TrainerSpec.prepare``: runs once when the engine exists, before resuming (the initial weights):
    DPO's and KTO's reference log-probabilities, the reward head's pad id."""

    def __call__(self, ctx: RunContext, engine: Engine, data: Datasets, collator: Collate) -> None: ...


class StepsBuilder(Protocol):
    """``TrainerSpec.steps``: ``(run context, engine, the run's loaders and plan, tokenizer) -> the loop's step
    feed`` (``training.steps.StepFeed``)."""

    def __call__(
        self, ctx: RunContext, engine: Engine, batches: Batches, tokenizer: PreTrainedTokenizerBase
    ) -> StepFeed: ...


class Schedule(Protocol):
    """``TrainerSpec.schedule``: ``(run config, training samples, batch sizes) -> (the samples the step plan
    counts, optimizer steps per batch)``. Raises ``UserError`` when the data cannot fill one batch."""

    def __call__(self, config: TrainerConfig, samples: int, sizes: BatchSizes) -> tuple[int, int]: ...


class MethodMemory(TypedDict, total=False):
    """What a method changes in the memory plan (``TrainerSpec.memory``)."""

    tokens_per_row_extra: int  # training rows are longer than the data's by this (grpo: the completion)
    generation_rows: bool  # a rank generates its step's rows at once (their KV cache)
    reference_model: bool  # a frozen reference model is held beside the policy
    vllm_share: float  # the share of each GPU an inference engine takes
    reward_models: list[tuple[str, str]]  # (config key, path) of reward models held whole on every process
    teacher_models: list[
        tuple[str, str, str]
    ]  # (config key, path, dtype) of causal LMs held whole and frozen


class MemoryHook(Protocol):
    """``TrainerSpec.memory``: ``(run config) -> what the method changes in the memory plan``."""

    def __call__(self, config: TrainerConfig) -> MethodMemory: ...


class ReportHook(Protocol):
    """``TrainerSpec.report``: ``(the data plan) -> lines`` the pre-flight report adds under the schedule."""

    def __call__(self, plan: DataPlan) -> list[str]: ...


@dataclass(frozen=True)
class TrainerSpec:
    """What a trainer (a training method) is made of and which component types it accepts.

    ``accepts`` maps a config slot (``model``, ``tokenizer``, ``data``, ``optimizer``, ``scheduler``,
    ``checkpoint``) to the component names the trainer works with; the first one is the default when the
    config names no ``type``. The hooks, each typed by its Protocol above and given as the object or its place
    (``"package.module:attribute"``, imported on first use): ``loss`` (:class:`LossBuilder`), ``collator``
    (:class:`CollatorBuilder`; none: the padding collator), ``prepare`` (:class:`Prepare`, optional),
    ``steps`` (:class:`StepsBuilder`: by default the training loader's micro-batches grouped by the step plan;
    grpo makes its batches from rollouts), ``schedule`` (:class:`Schedule`: grpo counts completions and updates
    each generated batch ``num_iterations`` times), ``memory`` (:class:`MemoryHook`), ``report``
    (:class:`ReportHook`). ``perplexity``: the loss is a mean token NLL, so exp(loss) is logged as perplexity.
    ``rows_per_sample``: the sequences one sample puts through the model at once (2 for a preference pair);
    the memory plan counts activations by it. Where a method implements a hook, its docstring names it.
    """

    name: str
    accepts: dict[str, tuple[str, ...]]
    loss: LossBuilder | str
    collator: CollatorBuilder | str | None = None
    prepare: Prepare | str | None = None
    description: str = ""
    perplexity: bool = True
    rows_per_sample: int = 1
    steps: StepsBuilder | str = "posttrain.training.steps:loader_steps"
    schedule: Schedule | str = "posttrain.plan:one_update_per_sample"
    memory: MemoryHook | str | None = None
    report: ReportHook | str | None = None


def hf_components(data: str) -> dict[str, tuple[str, ...]]:
    """What the built-in trainers accept: HF model (or Liger's) and tokenizer, their own data factory, torch
    AdamW or DeepSpeed's CPU/fused Adam, the HF scheduler family, and both checkpoint engines (export first, the default)."""
    return {
        "model": ("huggingface", "liger"),
        "tokenizer": ("huggingface",),
        "data": (data,),
        "optimizer": ("adamw", "cpu_adam", "fused_adam", "fused_adam_moe"),
        "scheduler": ("huggingface", "megatron"),
        "checkpoint": ("huggingface", "deepspeed"),
    }


TRAINERS: Registry[TrainerSpec] = Registry("trainer")
MODEL_FACTORIES: Registry[ModelFactory] = Registry("model", adapt=as_model_factory)
TOKENIZER_FACTORIES: Registry[TokenizerFactory] = Registry("tokenizer")
DATA_SOURCES: Registry[DataSource] = Registry("data source")
DATA_FACTORIES: Registry[DataFactory] = Registry("data")
OPTIMIZERS: Registry[OptimizerFactory] = Registry("optimizer")
SCHEDULERS: Registry[SchedulerFactory] = Registry("scheduler")
CHECKPOINT_ENGINES: Registry[CheckpointEngineFactory] = Registry("checkpoint")
GENERATION_ENGINES: Registry[GenerationEngineFactory] = Registry("generation engine")
#: the model stage's transforms, in the order they apply (``posttrain.stages.model.prepare_model``)
MODEL_TRANSFORMS: OrderedTable[ModelTransform] = OrderedTable("model transform")
#: what a model feature adds to every training step (a loss term, metrics), in order
STEP_EXTRAS: OrderedTable[StepExtraFactory] = OrderedTable("step extra")


@dataclass(frozen=True)
class Slot:
    """A config key whose sub-config class is chosen by its ``type:`` name."""

    name: str
    registry: Registry[Any]
    many: bool = False
    """A list of components (the checkpoint engines) rather than one."""
    filled: bool = False
    """Absent from the file: the trainer's default type with its default settings."""


#: every component slot of a config, in resolution order: the one table the loader, schema and docs read
COMPONENT_SLOTS: tuple[Slot, ...] = (
    Slot("model", MODEL_FACTORIES),
    Slot("tokenizer", TOKENIZER_FACTORIES, filled=True),
    Slot("data", DATA_FACTORIES),
    Slot("optimizer", OPTIMIZERS, filled=True),
    Slot("scheduler", SCHEDULERS, filled=True),
    Slot("checkpoint", CHECKPOINT_ENGINES, many=True),
)

#: config slot -> the registry that resolves its ``type:``
SLOT_REGISTRIES: dict[str, Registry[Any]] = {slot.name: slot.registry for slot in COMPONENT_SLOTS}
