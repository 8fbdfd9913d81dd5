"""Figures that drift carry their date and their command: a paragraph of the README or docs/ that states a
measured figure (a bold number, a ratio such as ``1.2x the``, a time such as ``in 30 s`` or ``4 min 21 s``)
names the day it was measured (``YYYY-MM-DD``) in the same paragraph, so a reader can tell how old it is, and
the command that measures it (a benchmark script, a make target, a ``posttrain`` command, an example or a
test) in the paragraph or earlier in its section, so a reader can measure it again. Tables carry their dates
in a column or the paragraph above them; code blocks and generated pages are left out."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = {"reference.md", "commands.md"}
FIGURE = re.compile(
    r"\*\*[0-9][0-9.,]*(x|%| s| min|K|M)?\*\*|[0-9.]+x (the|faster|slower|bare|a )|in [0-9]+ s\b|[0-9]+ min [0-9]+ s"
)
DATE = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}")
COMMAND = re.compile(
    r"benchmarks/[\w/]+\.(py|sh)|make [a-z][a-z-]*|posttrain [a-z][a-z-]+|examples/\w+\.py|tests/[\w/]+\.py"
    r"|\.ci/run|pytest"
)


def paragraphs(text: str) -> list[str]:
    """The page's prose paragraphs: fenced code blocks and tables left out."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [p for p in prose.split("\n\n") if p.strip() and not p.lstrip().startswith("|")]


def sections(text: str) -> list[tuple[str, str]]:
    """Each prose paragraph of the page with the text of its section before it (from its heading on)."""
    out, before = [], ""
    for paragraph in re.sub(r"```.*?```", "", text, flags=re.S).split("\n\n"):
        if paragraph.lstrip().startswith("#"):
            before = ""
        if paragraph.strip() and not paragraph.lstrip().startswith("|"):
            out.append((paragraph, before))
        before += "\n\n" + paragraph
    return out


def test_every_measured_figure_names_the_command_that_measures_it() -> None:
    unsourced = [
        f"{page.relative_to(ROOT)}: {paragraph.strip()[:100]}"
        for page in PAGES
        if page.name not in GENERATED and not page.name.startswith("from-")
        for paragraph, before in sections(page.read_text())
        if FIGURE.search(paragraph) and not COMMAND.search(before + paragraph)
    ]
    assert not unsourced, "figures without the command that measures them:\n" + "\n".join(unsourced)


def test_every_measured_figure_carries_its_date() -> None:
    undated = [
        f"{page.relative_to(ROOT)}: {paragraph.strip()[:100]}"
        for page in PAGES
        if page.name not in GENERATED and not page.name.startswith("from-")
        for paragraph in paragraphs(page.read_text())
        if FIGURE.search(paragraph) and not DATE.search(paragraph)
    ]
    assert not undated, "figures without the day they were measured:\n" + "\n".join(undated)
