"""``docs/commands.md``, generated from the command parsers (the one source: what ``posttrain NAME --help``
says). ``python -m posttrain.commands.docs_page > docs/commands.md`` writes it; a test keeps the file current."""

from __future__ import annotations

import argparse

from posttrain.commands import Command, all_commands, command_parser
from posttrain.utils.markdown import contents

HEADER = """# The command line in full

Every command with every argument, generated from the command parsers by
`python -m posttrain.commands.docs_page > docs/commands.md`; do not edit by hand
(`tests/unit/test_commands_page.py` fails when this page is out of date). `posttrain COMMAND --help` says the
same; the README has the short table.
"""

FOOTER = """## Overrides and errors

Overrides use dotted paths with list indices: `data.sources[0].sample_ratio=0.5`, `checkpoint.0.output_dir=out`.
Config errors (and bad data rows) print without a traceback and exit with status 2, all of them at once
([an example](configuration.md#keys-numbers-aliases-and-errors)).
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
        return flags if action.nargs == 0 else f"{flags} `{action.metavar or action.dest.upper()}`"
    return f"`{action.metavar or action.dest.upper()}`"


def _default(action: argparse.Action) -> str:
    if action.required and action.nargs not in ("?", "*"):
        return "required"
    if action.nargs == 0 or action.default in (None, "", [], argparse.SUPPRESS):
        return ""
    value = action.default
    return f"`{' '.join(map(str, value)) if isinstance(value, list) else value}`"


def _rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):  # one table per sub-command, after this one
            continue
        choices = f" (one of: {', '.join(map(str, action.choices))})" if action.choices else ""
        rows.append(
            f"| {_name(action)} | {_default(action)} | " + _cell((action.help or "") + choices) + " |"
        )
    return rows


def _section(entry: Command) -> list[str]:
    parser = command_parser(entry)
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    lines = [
        f"## posttrain {entry.name}",
        "",
        _cell(entry.description or entry.help),
        "",
        "```",
        usage,
        "```",
        "",
    ]
    rows = _rows(parser)
    if rows:
        lines += ["| argument | default | what it is |", "|---|---|---|", *rows, ""]
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            sub_usage = " ".join(sub.format_usage().removeprefix("usage: ").split())
            lines += [f"`{sub_usage}`: {_cell(helps.get(name) or '')}", ""]
            rows = _rows(sub)
            if rows:
                lines += ["| argument | default | what it is |", "|---|---|---|", *rows, ""]
    return lines


def commands_markdown() -> str:
    """The whole page."""
    commands = list(all_commands().values())
    headings = [f"posttrain {entry.name}" for entry in commands] + ["Overrides and errors"]
    lines = [HEADER, *contents(headings), ""]
    for entry in commands:
        lines += _section(entry)
    return "\n".join(lines) + FOOTER


if __name__ == "__main__":
    print(commands_markdown(), end="")
