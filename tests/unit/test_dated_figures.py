"""Figures that drift carry their date: a paragraph of the README or docs/ that states a measured figure (a
bold number, a ratio such as ``1.2x the``, a time such as ``in 30 s`` or ``4 min 21 s``) names the day it
was measured (``YYYY-MM-DD``) in the same paragraph, so a reader can tell how old it is. Tables carry their
dates in a column or the paragraph above them; code blocks and generated pages are left out."""

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


def paragraphs(text: str) -> list[str]:
    """The page's prose paragraphs: fenced code blocks and tables left out."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [p for p in prose.split("\n\n") if p.strip() and not p.lstrip().startswith("|")]


def test_every_measured_figure_carries_its_date() -> None:
    undated = [
        f"{page.relative_to(ROOT)}: {paragraph.strip()[:100]}"
        for page in PAGES
        if page.name not in GENERATED and not page.name.startswith("from-")
        for paragraph in paragraphs(page.read_text())
        if FIGURE.search(paragraph) and not DATE.search(paragraph)
    ]
    assert not undated, "figures without the day they were measured:\n" + "\n".join(undated)
