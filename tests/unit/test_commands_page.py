"""docs/commands.md is generated from the command parsers, and the README's short table of commands names
what the parsers take."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from posttrain.commands import all_commands, command_parser
from posttrain.testing.env import child_env

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "commands.md"


def test_the_commands_page_is_current() -> None:
    """Generated in a fresh process (commands other tests register must not appear)."""
    command = [sys.executable, "-m", "posttrain.commands.docs_page"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=child_env(), check=True)
    assert PAGE.read_text() == done.stdout, (
        "docs/commands.md is out of date: run `python -m posttrain.commands.docs_page > docs/commands.md`"
    )


def _readme_rows() -> dict[str, str]:
    section = (ROOT / "README.md").read_text().split("\n## The command line\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `posttrain ([\w-]+)([^`]*)` \|", line)
        if match:
            rows[match.group(1)] = match.group(2).replace("\\|", "|")
    return rows


def test_the_readme_table_names_every_command_with_flags_and_choices_that_exist() -> None:
    rows = _readme_rows()
    commands = all_commands()
    assert sorted(rows) == sorted(commands), "the README's command table and the parsers list other commands"
    for name, usage in rows.items():
        parser = command_parser(commands[name])
        parsers = [parser] + [
            sub
            for a in parser._actions
            if isinstance(a, argparse._SubParsersAction)
            for sub in a.choices.values()
        ]
        flags = {flag for p in parsers for action in p._actions for flag in action.option_strings}
        written = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage))
        assert written <= flags, (name, written - flags)
        for group in re.findall(r"\[?([\w-]+(?:\|[\w-]+)+)\]?", usage):  # a|b|c: every choice, none missing
            written_choices = set(group.split("|"))
            owners = [a for a in parser._actions if a.choices and written_choices & set(map(str, a.choices))]
            assert owners, (name, group)
            assert written_choices == set(map(str, owners[0].choices)), (name, group, owners[0].choices)
