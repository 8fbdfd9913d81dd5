"""``posttrain`` command line: the parser built from the commands' table (``posttrain.commands``), and the
exit status: 2 for a config or user error, printed without a traceback."""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.commands import all_commands, command_parser
from posttrain.errors import UserError
from posttrain.launch import EXIT_USER_ERROR, note_user_error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain", description="Fine-tune and post-train LLMs from one YAML file."
    )
    parser.add_argument("--version", action="version", version=f"posttrain {version()}")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by launchers
    sub = parser.add_subparsers(dest="command", required=True)
    for entry in all_commands().values():
        command_parser(entry, sub)
    return parser


def version() -> str:
    """posttrain's version, and the torch it runs on (what a bug report needs first)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from posttrain import __version__

    try:
        torch = installed("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"{__version__} (torch {torch}, Python {sys.version.split()[0]})"


def _quiet_environment() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from posttrain.utils.imports import choose_accelerator_on_demand

    choose_accelerator_on_demand()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_environment()
    from posttrain.config.errors import ConfigError

    try:
        return all_commands()[args.command].run(args)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        note_user_error()
        return EXIT_USER_ERROR
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        note_user_error()
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
