"""Stage 1 of loading: YAML text to plain data, with the line of every key and duplicate keys refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.config.errors import ConfigError, ConfigIssue, format_path

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
