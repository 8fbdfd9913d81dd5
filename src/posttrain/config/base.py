"""The base of every config model: strict keys, attribute docstrings, and cross-field checks that report."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Problem(tuple[str, str]):
    """A cross-field problem: (dotted key path relative to the model, message)."""

    __slots__ = ()

    def __new__(cls, path: str, message: str) -> Problem:
        return super().__new__(cls, (path, message))


@dataclass(frozen=True)
class ModeKeys:
    """``keys`` of a config class take effect only when ``applies(section, root)`` (the section holding
    them, the whole run config); ``needs`` says when. Written while their mode is off, they are warned
    about (``config.mode_keys``)."""

    keys: tuple[str, ...]
    applies: Callable[[Any, Any], bool]
    needs: str


def uses_adapters(section: Any, root: Any) -> bool:
    """The run trains LoRA adapters (new ones, or a saved one)."""
    return root.model.peft_config is not None or root.model.peft_pretrained is not None


class BaseConfig(BaseModel):
    """Common behaviour: unknown keys are errors; field docstrings become the schema's descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        populate_by_name=True,
        validate_assignment=False,
    )

    mode_keys: ClassVar[tuple[ModeKeys, ...]] = ()
    """Keys of this class that apply only in some modes (each class declares its own)."""

    def problems(self) -> Iterator[Problem]:
        """Cross-field checks of this model (values only, no I/O). Sub-models are walked by the caller."""
        return iter(())

    def all_problems(self, prefix: str = "") -> Iterator[Problem]:
        """Problems of this model and, recursively, of every sub-config, with full key paths."""
        for path, message in self.problems():
            yield Problem(join_path(prefix, path), message)
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for index, item in items:
                if isinstance(item, BaseConfig):
                    child = join_path(prefix, name) + (f"[{index}]" if index is not None else "")
                    yield from item.all_problems(child)


def join_path(prefix: str, path: str) -> str:
    if not prefix:
        return path
    if not path:
        return prefix
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


def unsupported(path: str, value: Any, default: Any, issue: str) -> Iterator[Problem]:
    """Refuse a value for a key whose feature is not built yet (never ignore it silently)."""
    if value != default:
        yield Problem(
            path,
            f"{value!r} is not supported yet ({issue}); remove the key or set it to its default {default!r}",
        )


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The config class inside a field's annotation (``Sub``, ``Sub | None``, ``list[Sub]``...), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = nested_model(arg)
        if found is not None:
            return found
    return None


def tagged_members(annotation: Any) -> dict[str, type[BaseModel]]:
    """The config classes of a union told apart by their ``type`` (``rewards``' entries), by that type;
    empty when the annotation is no such union."""
    found: dict[str, type[BaseModel]] = {}
    stack = [annotation]
    while stack:
        item = stack.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            tag = item.model_fields.get("type")
            if tag is not None and isinstance(tag.default, str):
                found[tag.default] = item
        else:
            stack.extend(typing.get_args(item))
    return found if len(found) > 1 else {}


def plain_loc(
    cls: type[BaseModel] | None, loc: tuple[Any, ...]
) -> tuple[tuple[Any, ...], type[BaseModel] | None]:
    """``loc`` as the config file writes it (pydantic puts the chosen member's tag into the location of a
    tagged union's error: ``rewards.0.exact_match.column`` is ``rewards[0].column``), and the config class
    found there (None where it is not a model)."""
    out: list[Any] = []
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        out.append(part)
        if isinstance(part, int) or cls is None:
            continue
        info = cls.model_fields.get(str(part))
        if info is None:
            cls = None
            continue
        while parts and isinstance(parts[0], int):
            out.append(parts.pop(0))
        members = tagged_members(info.annotation)
        cls = (
            members[parts.pop(0)]
            if members and parts and parts[0] in members
            else nested_model(info.annotation)
        )
    return tuple(out), cls


def model_at(cls: type[BaseModel] | None, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config class at ``loc`` below ``cls`` (list indices skipped), or None where it is not a model."""
    return plain_loc(cls, loc)[1]


def field_names(cls: type[BaseModel], *, deprecated: bool = True) -> set[str]:
    """The keys ``cls`` accepts: field names and aliases (without fields marked deprecated, if asked)."""
    fields = {
        name: info
        for name, info in cls.model_fields.items()
        if deprecated
        or not (isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("deprecated"))
    }
    return set(fields) | {info.alias for info in fields.values() if info.alias}


#: an unknown-key message lists the allowed keys up to this many; beyond, the close ones and where to find all
ALLOWED_SHOWN = 12
#: words of a key name that say nothing about what it is for: sharing one makes no two keys related
FILLER_WORDS = frozenset(
    "a an and at by for in is of on or per the to with path dir file name size type config enable use num max min".split()
)


def _words(name: str) -> set[str]:
    return {w for w in str(name).lower().split("_") if len(w) > 1 and w not in FILLER_WORDS}


def _same_word(a: str, b: str) -> bool:
    """The same word, or one misspelled (``lerning`` for ``learning``)."""
    return a == b or (min(len(a), len(b)) >= 5 and difflib.SequenceMatcher(None, a, b).ratio() >= 0.8)


def close_keys(key: str, allowed: list[str] | set[str] | frozenset[str], limit: int = 6) -> list[str]:
    """The allowed keys close to ``key``: spelled alike (a typo, a missing part: ``micro_batch`` for
    ``micro_batch_size``), or sharing a word that means something (``eval`` in ``eval_steps`` and
    ``eval_interval``; not ``path`` or ``name``). The closest first; none when nothing is close."""
    names = sorted(allowed)
    spelled = difflib.get_close_matches(str(key), names, n=limit, cutoff=0.75)
    words = _words(key)
    shared = {
        name: sum(any(_same_word(w, v) for v in _words(name)) for w in words)
        for name in names
        if name not in spelled
    }
    sharing = sorted(
        (name for name, count in shared.items() if count),
        key=lambda name: (-shared[name], -difflib.SequenceMatcher(None, str(key), name).ratio(), name),
    )
    return [*spelled, *sharing][:limit]


def allowed_keys(key: str, allowed: list[str] | set[str] | frozenset[str]) -> str:
    """``(allowed: a, b, c)``, or for a long list the keys close to ``key`` (:func:`close_keys`), if any, and
    where all of them are listed."""
    names = sorted(allowed)
    if len(names) <= ALLOWED_SHOWN:
        return f"(allowed: {', '.join(names)})"
    close = close_keys(key, names)
    shown = f"close: {', '.join(close)}; " if close else ""
    return f"({shown}{len(names)} keys in all: `posttrain schema --markdown` or docs/reference.md)"


#: other trainers' top-level keys (TRL / transformers' ``TrainingArguments``, Axolotl, LLaMA-Factory) and
#: posttrain's key for the same setting: an unknown top-level key among them is pointed there
OTHER_TRAINERS_KEYS = {
    "learning_rate": "optimizer.lr",
    "lr": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "adam_beta1": "optimizer.betas",
    "adam_beta2": "optimizer.betas",
    "adam_epsilon": "optimizer.eps",
    "optim": "optimizer.type",
    "lr_scheduler_type": "scheduler.name",
    "lr_scheduler": "scheduler.name",
    "warmup_ratio": "scheduler.warmup_ratio",
    "warmup_steps": "scheduler.warmup_steps",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "max_steps": "train_iters",
    "per_device_train_batch_size": "micro_batch_size",
    "per_device_eval_batch_size": "micro_batch_size",
    "sequence_len": "data.max_length",
    "max_seq_length": "data.max_length",
    "max_length": "data.max_length",
    "cutoff_len": "data.max_length",
    "sample_packing": "data.pack_samples",
    "packing": "data.pack_samples",
    "dataset_name": "data.sources",
    "dataset": "data.sources",
    "datasets": "data.sources",
    "val_set_size": "data.train_eval_split",
    "base_model": "model.name_or_path",
    "model_name_or_path": "model.name_or_path",
    "bf16": "model.dtype: bfloat16",
    "fp16": "model.dtype: float16",
    "torch_dtype": "model.dtype",
    "gradient_checkpointing": "model.disable_activation_checkpoint (checkpointing is on by default)",
    "adapter": "model.peft_config",
    "lora_r": "model.peft_config.r",
    "lora_alpha": "model.peft_config.lora_alpha",
    "lora_dropout": "model.peft_config.lora_dropout",
    "lora_target_modules": "model.peft_config.target_modules",
    "output_dir": "logger.output_dir and checkpoint[].output_dir",
    "logging_steps": "loss_log_interval",
    "eval_steps": "eval_interval",
    "save_steps": "checkpoint[].save_every_n_steps",
    "resume_from_checkpoint": "checkpoint[].auto_resume",
    "report_to": "metrics / wandb / tensorboard",
}


def other_trainers_hint(key: str) -> str:
    """``; posttrain's key for it is X`` for another trainer's top-level name, or nothing."""
    where = OTHER_TRAINERS_KEYS.get(str(key))
    return f"; TRL's, Axolotl's or LLaMA-Factory's name: posttrain's is {where}" if where else ""


def did_you_mean(key: str, allowed: list[str] | set[str] | frozenset[str]) -> str:
    """``; did you mean 'x'?`` for the closest allowed key, or nothing."""
    close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
