"""Config errors: every problem of a config collected, each with its key path and where it was written."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: ``path`` is the dotted key path (``data.sources[0].sample_ratio``), ``where`` says where
    the key was written (``run.yaml:12``, ``command line``) or is empty for a key that was not written."""

    path: str
    message: str
    where: str = ""

    def render(self) -> str:
        location = f"{self.where}: " if self.where else ""
        key = f"{self.path}: " if self.path else ""
        return f"{location}{key}{self.message}"


class ConfigError(Exception):
    """Raised with all the problems of a config at once. The CLI prints them and exits with status 2."""

    def __init__(self, issues: list[ConfigIssue], source: str = "") -> None:
        self.issues = issues
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.issues)
        head = f"{count} config error{'s' if count != 1 else ''}" + (
            f" in {self.source}" if self.source else ""
        )
        return head + ":\n" + "\n".join(f"  - {issue.render()}" for issue in self.issues)


def format_path(loc: tuple[str | int, ...]) -> str:
    """('data', 'sources', 0, 'sample_ratio') -> 'data.sources[0].sample_ratio'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
