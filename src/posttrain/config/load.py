"""From a YAML file and command-line overrides to a validated ``TrainerConfig``.

Three stages, all without side effects other than importing the user's ``code:`` module:

1. **load** — YAML with duplicate keys refused (both lines named) and the line of every key remembered;
   ``key.path=value`` overrides applied on top.
2. **resolve** — each ``type:`` name is looked up in its registry (unknown names list the registered ones;
   types the trainer does not accept are refused unless ``skip_validation``), giving the config class of
   every sub-config.
3. **validate** — pydantic validation of every part, errors of all parts collected, then cross-field checks
   and derived defaults. The result is plain data: nothing is opened, created or started.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.util
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from posttrain.config.data import LOCAL_SUFFIXES
from posttrain.config.errors import ConfigError, ConfigIssue, format_path
from posttrain.config.trainer import TYPED_SLOTS, TrainerConfig
from posttrain.registry import (
    DATA_SOURCES,
    SLOT_REGISTRIES,
    TRAINERS,
    Registry,
    TrainerSpec,
    UnknownComponentError,
)

Loc = tuple[str | int, ...]


@dataclass
class RawConfig:
    """The config as written: plain data plus where each key came from."""

    data: dict[str, Any]
    origins: dict[Loc, str] = field(default_factory=dict)
    derived: set[Loc] = field(default_factory=set)
    source: str = ""
    base_dir: Path = field(default_factory=Path.cwd)
    issues: list[ConfigIssue] = field(default_factory=list)

    def where(self, loc: Loc) -> str:
        """Origin of the deepest written key on ``loc`` (the key itself, or the block that lacks it)."""
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.origins:
                return self.origins[loc[:end]]
        return ""


# --------------------------------------------------------------------------------------------------- load


def _node_value(loader: yaml.SafeLoader, node: yaml.Node, loc: Loc, raw: RawConfig, name: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)  # resolves `<<:` merge keys
        out: dict[Any, Any] = {}
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raw.issues.append(
                    ConfigIssue(
                        format_path((*loc, key)),
                        f"duplicate key: first on line {first_line[key]}, again on line {line}; keep one",
                        f"{name}:{line}",
                    )
                )
                continue
            first_line[key] = line
            raw.origins[(*loc, key)] = f"{name}:{line}"
            out[key] = _node_value(loader, value_node, (*loc, key), raw, name)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            raw.origins[(*loc, index)] = f"{name}:{item.start_mark.line + 1}"
            items.append(_node_value(loader, item, (*loc, index), raw, name))
        return items
    return loader.construct_object(node, deep=True)


def load_yaml_text(text: str, name: str = "<config>", base_dir: Path | None = None) -> RawConfig:
    """Parse YAML text, recording the line of every key and refusing duplicate keys."""
    raw = RawConfig(data={}, source=name, base_dir=base_dir or Path.cwd())
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        value = _node_value(loader, node, (), raw, name) if node is not None else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark else name
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue("", f"invalid YAML: {problem}", where)], name) from None
    finally:
        loader.dispose()
    if not isinstance(value, dict):
        raise ConfigError([ConfigIssue("", "the file must hold a mapping of keys (key: value)", name)], name)
    raw.data = value
    return raw


def load_yaml(path: str | Path) -> RawConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [ConfigIssue("", f"cannot read the config file: {exc.strerror}", str(path))]
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"the config file is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                    f"{exc.start}); save it as UTF-8",
                    str(path),
                )
            ]
        ) from None
    return load_yaml_text(text, str(path), path.resolve().parent)


def _parse_override_path(text: str) -> Loc:
    loc: list[str | int] = []
    for part in text.replace("[", ".").replace("]", "").split("."):
        if not part:
            raise ValueError(f"empty key in {text!r}")
        loc.append(int(part) if part.isdigit() else part)
    return tuple(loc)


@functools.cache
def alias_twins() -> dict[str, str]:
    """Field name <-> alias of every config class (``lr``/``learning_rate``...), so an override written
    with one spelling replaces the other spelling in the file."""
    from posttrain.builtins import register_builtins
    from posttrain.config.trainer import TrainerConfig
    from posttrain.registry import SLOT_REGISTRIES, TRAINERS

    register_builtins()
    classes: list[type[BaseModel]] = [TrainerConfig]
    for registry in [*SLOT_REGISTRIES.values(), TRAINERS]:
        classes += [registry.get(name).config for name in registry.names()]
    twins: dict[str, str] = {}
    seen: set[type] = set()
    while classes:
        cls = classes.pop()
        if cls in seen or not isinstance(cls, type) or not issubclass(cls, BaseModel):
            continue
        seen.add(cls)
        for name, info in cls.model_fields.items():
            if info.alias:
                twins[name], twins[info.alias] = info.alias, name
            nested = _unwrap_model(info.annotation)
            if nested is not None:
                classes.append(nested)
    return twins


def apply_overrides(raw: RawConfig, overrides: list[str]) -> None:
    """Apply ``key.path=value`` overrides (values parsed as YAML scalars/lists/maps)."""
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raw.issues.append(
                ConfigIssue("", f"override {override!r} is not of the form key.path=value", "command line")
            )
            continue
        try:
            loc = _parse_override_path(key.strip())
            value = yaml.safe_load(text) if text.strip() else ""
        except (ValueError, yaml.YAMLError) as exc:
            raw.issues.append(ConfigIssue(key, f"bad override {override!r}: {exc}", "command line"))
            continue
        target: Any = raw.data
        for depth, part in enumerate(loc[:-1]):
            nxt = loc[depth + 1]
            if isinstance(target, dict):
                if not isinstance(target.get(part), dict | list):
                    target[part] = [] if isinstance(nxt, int) else {}
                target = target[part]
            elif isinstance(target, list) and isinstance(part, int) and part <= len(target):
                if part == len(target):
                    target.append([] if isinstance(nxt, int) else {})
                elif isinstance(target[part], str) and not isinstance(nxt, int):
                    target[part] = {"name_or_path": target[part]}  # a source's string shorthand
                target = target[part]
            else:
                target = None
                break
        last = loc[-1]
        if isinstance(target, dict):
            twin = alias_twins().get(str(last))
            if twin is not None and twin in target:  # `lr=` replaces a `learning_rate:` from the file
                del target[twin]
            target[last] = value
        elif isinstance(target, list) and isinstance(last, int) and last <= len(target):
            target[last : last + 1] = [value]
        else:
            raw.issues.append(
                ConfigIssue(
                    format_path(loc), f"override {override!r} does not fit the config's shape", "command line"
                )
            )
            continue
        for end in range(1, len(loc) + 1):
            raw.origins.setdefault(loc[:end], "command line")
        raw.origins[loc] = "command line"


# ---------------------------------------------------------------------------------------------- user code


def load_user_code(raw: RawConfig) -> None:
    """Import the ``code:`` file (default ``train.py`` beside the config, only if it exists)."""
    explicit = "code" in raw.data
    value = raw.data.get("code", "train.py")
    if not isinstance(value, str):
        return  # pydantic reports the wrong type
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = raw.base_dir / path
    path = path.resolve()
    if not path.is_file():
        if explicit:
            raw.issues.append(ConfigIssue("code", f"{value!r}: no such file ({path})", raw.where(("code",))))
        return
    raw.data["code"] = str(path)
    try:
        import_user_module(path)
    except Exception as exc:
        raw.issues.append(
            ConfigIssue("code", f"importing {path} failed: {_where_in(exc, path)}", raw.where(("code",)))
        )


def _where_in(exc: BaseException, path: Path) -> str:
    """``Type: message (at file:line)`` for the deepest frame of the user's file."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
    at = f" (at {path.name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def import_user_module(path: Path) -> None:
    """Import a user file once per process under a name derived from its path (stable across ranks)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"posttrain_user_{path.stem}_{digest}"
    if module_name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise


# ------------------------------------------------------------------------------------------------ resolve


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
            err_loc = tuple(error["loc"])
            if err_loc and err_loc[0] in skip:
                continue
            full = (*loc, *err_loc)
            kind = error["type"]
            if kind == "extra_forbidden":
                owner = _model_at(cls, err_loc[:-1])
                allowed = sorted(_field_names(owner)) if owner else []
                key = str(err_loc[-1])
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.add(full, f"unknown key{hint} (allowed: {', '.join(allowed)})")
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


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def _model_at(cls: type[BaseModel] | None, loc: Loc) -> type[BaseModel] | None:
    for part in loc:
        if cls is None:
            return None
        if isinstance(part, int):
            continue
        info = cls.model_fields.get(part)
        cls = _unwrap_model(info.annotation) if info else None
    return cls


def _field_names(cls: type[BaseModel]) -> set[str]:
    names = set(cls.model_fields)
    names.update(info.alias for info in cls.model_fields.values() if info.alias)
    return names


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
    for slot in (*TYPED_SLOTS, "checkpoint"):
        if slot not in data:
            continue
        registry = SLOT_REGISTRIES[slot]
        values = data[slot] if slot == "checkpoint" else [data[slot]]
        if slot == "checkpoint" and not isinstance(values, list):
            values = [values]
        instances = []
        for index, value in enumerate(values):
            loc: Loc = (slot, index) if slot == "checkpoint" else (slot,)
            if not isinstance(value, dict):
                v.add(loc, f"{_short(value)}: expected a mapping of keys")
                failed.add(slot)
                continue
            value = dict(value)
            cls = v.component(registry, slot, value, loc, spec, skip_validation)
            if cls is None:
                failed.add(slot)
                continue
            nested_failed: set[str] = set()
            if slot == "data":
                _resolve_sources(v, value, loc, nested_failed)
            try:
                instances.append(cls.model_validate(value))
            except ValidationError as exc:
                v.pydantic_errors(exc, cls, loc, skip=nested_failed)
                failed.add(slot)
            else:
                if nested_failed:
                    failed.add(slot)
        data[slot] = instances if slot == "checkpoint" else (instances[0] if instances else None)
    for slot in ("tokenizer", "optimizer", "scheduler"):
        if slot not in data and spec:
            default = {}
            cls = v.component(SLOT_REGISTRIES[slot], slot, default, (slot,), spec, skip_validation)
            if cls is not None:
                data[slot] = v.model(cls, default, (slot,))

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


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    text: str | None = None,
    data: dict[str, Any] | None = None,
    base_dir: Path | None = None,
) -> TrainerConfig:
    """Load, override, resolve and validate a config from a file, YAML text or a dict."""
    if path is not None:
        raw = load_yaml(path)
    elif text is not None:
        raw = load_yaml_text(text, base_dir=base_dir)
    else:
        raw = RawConfig(data=dict(data or {}), source="<dict>", base_dir=base_dir or Path.cwd())
    apply_overrides(raw, overrides or [])
    return resolve(raw)
