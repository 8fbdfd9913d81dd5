"""What the demos in ``examples/`` share: the time each takes on the 2-core CPU the docs measure, said before
it starts; a ``--short`` version; and stages that a rerun skips once they are done and resumes where they
stopped (each training run saves a resumable checkpoint every few steps and resumes from it, the records
continuing), ``--fresh`` starting over."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from posttrain.testing.served import die_with_parent


@dataclass(frozen=True)
class Expected:
    """A demo's wall time on the 2-core CPU of docs/development.md: the full and the ``--short`` version,
    and when they were measured."""

    full: str
    short: str
    measured: str


def arguments(parser: argparse.ArgumentParser, resumable: bool = True) -> argparse.ArgumentParser:
    """``--short`` (and, for a demo whose stages resume, ``--fresh``)."""
    parser.add_argument(
        "--short", action="store_true", help="a shorter version: fewer steps, a weaker result"
    )
    if resumable:
        parser.add_argument(
            "--fresh",
            action="store_true",
            help="start over (by default a stopped run resumes where it stopped)",
        )
    return parser


def say_expected(expected: Expected, short: bool, resumable: bool = True) -> None:
    """One line before the demo starts: how long it takes here, and how to make it shorter or resume it."""
    took = expected.short if short else expected.full
    other = "" if short else f"; --short: {expected.short}"
    again = "; stopped, it resumes where it stopped when run again (--fresh starts over)" if resumable else ""
    print(f"expected: {took} on a 2-core CPU (measured {expected.measured}){other}{again}", flush=True)


class Stages:
    """A demo's stages under ``out``: each runs once; a rerun skips those done (a marker written when one
    ends) and resumes the one that was stopped (its runs resume from their checkpoints). ``fresh``: the folder
    is emptied first. A short and a full demo keep separate folders."""

    def __init__(self, out: Path, fresh: bool) -> None:
        self.out = out
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)

    def _marker(self, name: str) -> Path:
        return self.out / f".{name}.done"

    def run(self, name: str, stage: Callable[[], None]) -> None:
        if self._marker(name).is_file():
            print(f"({name}: done earlier, kept; --fresh starts over)", flush=True)
            return
        started = time.time()
        stage()
        self._marker(name).write_text(f"{time.time() - started:.0f} s\n")


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a demo's ``posttrain`` commands: the child ends with the demo however the demo
    ends (a ``timeout``'s SIGTERM, a kill: its parent-death signal is SIGTERM, on which a training run saves
    its resumable checkpoint and stops; Ctrl-C reaches both already)."""
    return subprocess.run(command, preexec_fn=die_with_parent, **kwargs)


def popen(command: list[str], **kwargs: Any) -> subprocess.Popen:
    """:func:`run`'s ``Popen``: for a demo that reads the run's output as it comes."""
    return subprocess.Popen(command, preexec_fn=die_with_parent, **kwargs)


def resume_engine(run_dir: str | Path, every: int) -> dict:
    """The checkpoint engine a demo's run resumes from: every ``every`` steps under ``run_dir/resume``, the
    newest kept, ``auto_resume`` on."""
    return {
        "type": "deepspeed",
        "output_dir": f"{run_dir}/resume",
        "save_every_n_steps": every,
        "save_total_limit": 1,
        "auto_resume": True,
    }


def resume_override(run_dir: str | Path, every: int, index: int = 1) -> str:
    """:func:`resume_engine` as a ``checkpoint.N={...}`` command-line override (after the config's own
    engines)."""
    engine = yaml.safe_dump(
        resume_engine(run_dir, every), default_flow_style=True, sort_keys=False, width=10**6
    )
    return f"checkpoint.{index}={engine.strip()}"
