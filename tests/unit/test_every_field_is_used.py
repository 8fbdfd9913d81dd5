"""Every config field of every registered component is read by the run or refused: a field that nothing reads
would be a setting that is silently ignored.

"Read" means the field is accessed as an attribute (``.name``) or by its quoted name somewhere in the package
outside the config class that declares it (validators that refuse a value read it the same way).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from pydantic import BaseModel

from posttrain.config.base import nested_model
from posttrain.config.trainer import TrainerConfig
from posttrain.registry import DATA_SOURCES, SLOT_REGISTRIES, TRAINERS

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "posttrain"
#: fields consumed whole rather than by name (their values are passed on as a mapping)
CONSUMED_WHOLE = {"deepspeed"}


def config_classes() -> set[type[BaseModel]]:
    roots: list[type[BaseModel]] = [TrainerConfig]
    for registry in [*SLOT_REGISTRIES.values(), TRAINERS, DATA_SOURCES]:
        roots += [registry.get(name).config for name in registry.names()]
    seen: set[type[BaseModel]] = set()
    while roots:
        cls = roots.pop()
        if cls in seen or not cls.__module__.startswith("posttrain."):  # not components other tests register
            continue
        seen.add(cls)
        for info in cls.model_fields.values():
            nested = nested_model(info.annotation)
            if nested is not None:
                roots.append(nested)
    return seen


def test_every_config_field_is_read_or_refused() -> None:
    files = {path: path.read_text() for path in PACKAGE.rglob("*.py")}
    unread = []
    for cls in config_classes():
        declared_in = Path(inspect.getsourcefile(cls) or "")
        for name in cls.model_fields:
            if name in CONSUMED_WHOLE:
                continue
            pattern = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
            users = [path for path, text in files.items() if pattern.search(text)]
            # the declaring file counts only through attribute reads (its own checks), not the declaration
            if not any(path != declared_in or re.search(rf"\.{name}\b", files[path]) for path in users):
                unread.append(f"{cls.__name__}.{name}")
    assert not unread, (
        f"config fields nothing reads (read them, refuse them, or remove them): {sorted(unread)}"
    )
