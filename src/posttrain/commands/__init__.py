"""The commands of ``posttrain``: each one's arguments beside its handler, registered with :func:`command` into
``COMMANDS``, from which ``posttrain.cli`` builds the parser. A handler parses nothing and holds no training
logic: it calls the module that does the work and prints (docs/extending.md, "A command")."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Arguments = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # one line: ``posttrain --help``
    arguments: Arguments
    run: Handler
    description: str = ""  # what it does in full: ``posttrain NAME --help`` and docs/commands.md


#: every command, in the order ``posttrain --help`` lists them (the order of ``GROUPS``, then of each module)
COMMANDS: dict[str, Command] = {}
#: the modules that register commands, imported by :func:`all_commands`
GROUPS = ("posttrain.commands.run", "posttrain.commands.tools", "posttrain.commands.inference")


def command(
    name: str, help: str, arguments: Arguments, description: str = ""
) -> Callable[[Handler], Handler]:
    """Register the decorated handler as ``posttrain NAME`` with the arguments ``arguments`` adds; ``help`` is
    its line in ``posttrain --help``, ``description`` what ``posttrain NAME --help`` and docs/commands.md say."""

    def register(run: Handler) -> Handler:
        COMMANDS[name] = Command(name, help, arguments, run, " ".join(description.split()))
        return run

    return register


def command_parser(
    entry: Command, parent: argparse._SubParsersAction | None = None
) -> argparse.ArgumentParser:
    """The parser of one command: under ``posttrain``'s (``parent``), or alone (the generated page)."""
    options = {"help": entry.help, "description": entry.description or entry.help}
    if parent is None:
        parser = argparse.ArgumentParser(prog=f"posttrain {entry.name}", description=options["description"])
    else:
        parser = parent.add_parser(entry.name, **options)
    entry.arguments(parser)
    return parser


def all_commands() -> dict[str, Command]:
    """``COMMANDS`` with every group's commands registered (their handlers import their work on first use)."""
    for group in GROUPS:
        importlib.import_module(group)
    return COMMANDS


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """A config file and ``key.path=value`` overrides."""
    parser.add_argument("config", type=Path, help="the run's YAML file")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. optimizer.lr=1e-4")


def load(config: Path, overrides: list[str], warn: bool = True):  # -> TrainerConfig
    """Load and validate; print a warning for every written key whose mode is off (``train`` leaves that to
    the run's rank 0, so that it is printed once however the run is launched)."""
    from posttrain.config import load_config
    from posttrain.config.mode_keys import config_warnings

    loaded = load_config(config, overrides)
    if warn:
        for warning in config_warnings(loaded):
            print(f"warning: {warning}", file=sys.stderr)
    return loaded
