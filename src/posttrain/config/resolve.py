"""Stage 4 of loading: resolution and validation. Each ``type:`` name is looked up in its slot's registry
(unknown names list the registered ones; types the trainer does not accept are refused unless
``skip_validation``), every part is validated by its config class, the problems of all parts are collected,
then cross-field checks run and derived defaults are filled. The result is plain data: nothing is opened,
created or started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from posttrain.config.base import (
    allowed_keys,
    did_you_mean,
    field_names,
    model_at,
    other_trainers_hint,
    plain_loc,
)
from posttrain.config.data import LOCAL_SUFFIXES
from posttrain.config.errors import ConfigError, ConfigIssue, format_path
from posttrain.config.trainer import TrainerConfig
from posttrain.config.user_code import load_user_code
from posttrain.config.yaml_source import Loc, RawConfig
from posttrain.registry import (
    COMPONENT_SLOTS,
    DATA_SOURCES,
    TRAINERS,
    Registry,
    TrainerSpec,
    UnknownComponentError,
)


class _Validator:
    """Validates parts of the config and collects every problem with its path and origin."""

    def __init__(self, raw: RawConfig) -> None:
        self.raw = raw
        self.issues: list[ConfigIssue] = raw.issues

    def add(self, loc: Loc, message: str) -> None:
        self.issues.append(ConfigIssue(format_path(loc), message, self.raw.where(loc)))

    def model(self, cls: type[BaseModel], data: Any, loc: Loc) -> BaseModel | None:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            self.pydantic_errors(exc, cls, loc)
            return None

    def pydantic_errors(
        self, exc: ValidationError, cls: type[BaseModel], loc: Loc, skip: set[str] = frozenset()
    ) -> None:
        for error in exc.errors():
            err_loc = plain_loc(cls, tuple(error["loc"]))[0]
            if err_loc and err_loc[0] in skip:
                continue
            full = (*loc, *err_loc)
            kind = error["type"]
            if kind == "extra_forbidden":
                owner = model_at(cls, err_loc[:-1])
                allowed = sorted(field_names(owner)) if owner else []
                key = str(err_loc[-1])
                other = other_trainers_hint(key) if len(full) == 1 else ""
                if other:  # another trainer's name: where posttrain keeps it, not a close spelling
                    self.add(full, f"unknown key{other}")
                else:
                    self.add(full, f"unknown key{did_you_mean(key, allowed)} {allowed_keys(key, allowed)}")
            elif kind == "missing":
                self.add(full, "required key is missing")
            else:
                message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
                self.add(full, f"{_short(error.get('input'))}: {message}")

    def component(
        self,
        registry: Registry[Any],
        slot: str,
        data: dict[str, Any],
        loc: Loc,
        spec: TrainerSpec | None,
        skip_validation: bool,
    ) -> type | None:
        """The config class of the component named by ``data['type']`` (or the trainer's default)."""
        accepted = spec.accepts.get(slot, ()) if spec else ()
        name = data.get("type") or (accepted[0] if accepted else "")
        if not isinstance(name, str) or not name:
            self.add(
                (*loc, "type"),
                f"no type given and trainer has no default for {slot}; registered: {', '.join(registry.names())}",
            )
            return None
        try:
            entry = registry.get(name)
        except UnknownComponentError as exc:
            self.add((*loc, "type"), str(exc))
            return None
        if spec and accepted and name not in accepted and not skip_validation:
            self.add(
                (*loc, "type"),
                f"{name!r} is not accepted by the {spec.name!r} trainer (accepted: {', '.join(accepted)}); set skip_validation: true to use it anyway",
            )
            return None
        data["type"] = name
        return entry.config


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _source_dict(value: Any) -> Any:
    if isinstance(value, str):
        return {"type": "local" if value.endswith(LOCAL_SUFFIXES) else "huggingface", "name_or_path": value}
    if isinstance(value, dict) and not value.get("type") and isinstance(value.get("name_or_path"), str):
        path = value["name_or_path"]
        return {**value, "type": "local" if path.endswith(LOCAL_SUFFIXES) else "huggingface"}
    return value


def _note_source_shorthand(raw: RawConfig, item: Any, loc: Loc) -> None:
    """Provenance of what ``_source_dict`` fills in: the path of a plain-string source comes from where the
    string was written; an inferred ``type`` is derived."""
    if isinstance(item, str) and loc in raw.origins:
        raw.origins[(*loc, "name_or_path")] = raw.origins[loc]
    if isinstance(item, str) or (isinstance(item, dict) and not item.get("type")):
        raw.derived.add((*loc, "type"))


def _resolve_sources(v: _Validator, data: dict[str, Any], loc: Loc, failed: set[str]) -> None:
    for key in ("sources", "eval_sources"):
        items = data.get(key)
        if items is None:
            continue
        items = items if isinstance(items, list) else [items]
        resolved = []
        for index, item in enumerate(items):
            item_loc = (*loc, key, index)
            _note_source_shorthand(v.raw, item, item_loc)
            item = _source_dict(item)
            if not isinstance(item, dict):
                v.add(
                    item_loc, f"{_short(item)}: a source is a path/name string or a mapping with name_or_path"
                )
                failed.add(key)
                continue
            cls = v.component(DATA_SOURCES, "source", item, item_loc, None, True)
            instance = v.model(cls, item, item_loc) if cls else None
            if instance is None:
                failed.add(key)
            else:
                resolved.append(instance)
        data[key] = resolved


def resolve(raw: RawConfig, run_name: str | None = None) -> TrainerConfig:
    """Validate ``raw`` into a ``TrainerConfig``; raise ``ConfigError`` with every problem found."""
    v = _Validator(raw)
    data = dict(raw.data)
    load_user_code(raw)
    data["code"] = raw.data.get("code", data.get("code", "train.py"))

    trainer_name = data.get("type", "sft")
    spec: TrainerSpec | None = None
    config_cls: type[TrainerConfig] = TrainerConfig
    try:
        entry = TRAINERS.get(str(trainer_name))
        spec, config_cls = entry.obj, entry.config
    except UnknownComponentError as exc:
        v.add(("type",), str(exc))
    skip_validation = data.get("skip_validation") is True

    failed: set[str] = set()
    for slot in COMPONENT_SLOTS:
        name = slot.name
        if name not in data:
            if slot.filled and spec:
                default: dict[str, Any] = {}
                cls = v.component(slot.registry, name, default, (name,), spec, skip_validation)
                if cls is not None:
                    data[name] = v.model(cls, default, (name,))
            continue
        values = data[name] if slot.many else [data[name]]
        if slot.many and not isinstance(values, list):
            values = [values]
        instances = []
        for index, value in enumerate(values):
            loc: Loc = (name, index) if slot.many else (name,)
            if not isinstance(value, dict):
                v.add(loc, f"{_short(value)}: expected a mapping of keys")
                failed.add(name)
                continue
            value = dict(value)
            cls = v.component(slot.registry, name, value, loc, spec, skip_validation)
            if cls is None:
                failed.add(name)
                continue
            nested_failed: set[str] = set()
            if name == "data":
                _resolve_sources(v, value, loc, nested_failed)
            try:
                instances.append(cls.model_validate(value))
            except ValidationError as exc:
                v.pydantic_errors(exc, cls, loc, skip=nested_failed)
                failed.add(name)
            else:
                if nested_failed:
                    failed.add(name)
        data[name] = instances if slot.many else (instances[0] if instances else None)

    _scheduler_lr_to_optimizer(data)
    for slot in failed:
        data.pop(slot, None)
    try:
        config = config_cls.model_validate(data)
    except ValidationError as exc:
        v.pydantic_errors(exc, config_cls, (), skip=failed)
        config = None
    if config is not None and not v.issues:
        derived = fill_derived(config, run_name or _run_name(raw))
        config._origins = dict(raw.origins)
        config._derived = derived | raw.derived
        for path, message in config.all_problems():
            loc = tuple(
                int(p) if p.isdigit() else p for p in path.replace("[", ".").replace("]", "").split(".")
            )
            v.add(loc, message)
    if v.issues or config is None:
        raise ConfigError(v.issues, raw.source)
    return config


def _scheduler_lr_to_optimizer(data: dict[str, Any]) -> None:
    """The deprecated ``scheduler.lr`` sets ``optimizer.lr`` when that is not given."""
    scheduler, optimizer = data.get("scheduler"), data.get("optimizer")
    if scheduler is None or optimizer is None or getattr(scheduler, "lr", None) is None:
        return
    if "lr" not in optimizer.model_fields_set:
        optimizer.lr = scheduler.lr


def _run_name(raw: RawConfig) -> str:
    return Path(raw.source).stem if raw.source and not raw.source.startswith("<") else "run"


def fill_derived(config: TrainerConfig, run_name: str) -> set[Loc]:
    """Defaults derived from other values (pure string work: nothing is created or read); returns the
    locations it filled."""
    out = config.logger.output_dir or str(Path("runs") / run_name)
    filled: set[Loc] = set()
    targets: list[tuple[Loc, Any, str, str]] = [
        (("logger", "output_dir"), config.logger, "output_dir", out),
        (
            ("train_log_metrics_path",),
            config,
            "train_log_metrics_path",
            str(Path(out) / "train-log-metrics.jsonl"),
        ),
        (("kill_switch_path",), config, "kill_switch_path", str(Path(out) / "kill-switch")),
        (("mem_profiler_dir",), config, "mem_profiler_dir", str(Path(out) / "mem-prof")),
        (("data", "cache_dir"), config.data, "cache_dir", str(Path(out) / "data-cache")),
        (("tokenizer", "name_or_path"), config.tokenizer, "name_or_path", config.model.name_or_path),
        (("tensorboard", "log_dir"), config.tensorboard, "log_dir", str(Path(out) / "tensorboard")),
    ]
    for loc, owner, name, value in targets:
        if not getattr(owner, name):
            setattr(owner, name, value)
            filled.add(loc)
    return filled
