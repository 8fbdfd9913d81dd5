"""Stage 3 of loading: the user's ``code:`` module, imported before resolution so that the components it
registers can be named by ``type:``."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from posttrain.config.errors import ConfigIssue
from posttrain.config.yaml_source import RawConfig


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


def import_user_module(path: Path) -> ModuleType:
    """Import a user file once per process under a name derived from its path (stable across ranks)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"posttrain_user_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
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
    return module


def import_named(value: str, kind: str = "function") -> object:
    """The object a ``path/to/file.py:name`` entry names (``kind``: a function (any callable), a class, an
    environment (a class or any callable)), imported once per process; ValueError with what is wrong (the
    pydantic message of the key)."""
    file, _, name = value.rpartition(":")
    if not file.endswith(".py") or not name.isidentifier():
        form = {"class": "Class", "environment": "Class (or a function that returns one)"}.get(
            kind, "function"
        )
        raise ValueError(f"name {'an' if kind[0] in 'aeiou' else 'a'} {kind} as path/to/file.py:{form}")
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"no such file {path} (paths are relative to where posttrain runs)")
    try:
        module = import_user_module(path)
    except Exception as exc:
        raise ValueError(f"importing {path} failed: {_where_in(exc, path)}") from None
    found = getattr(module, name, None)
    test = (lambda v: isinstance(v, type)) if kind == "class" else callable
    if not test(found):
        names = sorted(
            n for n, v in vars(module).items() if test(v) and not n.startswith("_") and _defined_in(v, module)
        )
        raise ValueError(f"{path.name} has no {kind} {name!r} (it has: {', '.join(names) or 'none'})")
    return found


def _defined_in(value: object, module: ModuleType) -> bool:
    """Whether a module offers ``value`` as its own: a class or function it imported (``Path``, ``dataclass``)
    is not; other callables (a ``functools.partial``) are."""
    if isinstance(value, type) or inspect.isfunction(value):
        return value.__module__ == module.__name__
    return True
