"""docs/architecture.md's module table is the package as it is: every module of ``src/posttrain`` is named in
a row (by its path, or by its file name in the row of its folder), and every file a row names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "posttrain"


def rows() -> list[tuple[str, str]]:
    """(the row's module cell, the whole row) of the table under ``## Modules``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    found = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().isdigit():
            found.append((cells[2], line))
    return found


def folders(cell: str) -> list[str]:
    """The folders a row's module cell names (``rollout/``, ``methods/grpo/``)."""
    return re.findall(r"`([\w/]+/)`", cell)


def test_every_module_is_in_the_table() -> None:
    table = rows()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" or "/__pycache__/" in relative:
            continue
        named = any(f"`{relative}`" in line for _, line in table)
        in_folder = any(
            relative == folder + path.name and f"`{path.name}`" in line
            for cell, line in table
            for folder in folders(cell)
        )
        if not (named or in_folder):
            missing.append(relative)
    assert not missing, f"modules docs/architecture.md's table does not name: {missing}"


def test_every_file_the_table_names_exists() -> None:
    ghosts = []
    for cell, line in rows():
        for name in re.findall(r"`([\w/]+\.py)`", line):
            if "/" in name:  # a path in the package, or in the repository (a test)
                if not ((PACKAGE / name).exists() or (ROOT / name).exists()):
                    ghosts.append(name)
            elif not any((PACKAGE / where / name).exists() for where in [*folders(cell), ""]):
                ghosts.append(f"{name} (row {cell.strip()})")
    assert not ghosts, f"docs/architecture.md's table names files that do not exist: {ghosts}"
