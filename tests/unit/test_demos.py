"""The demos' shared parts (``posttrain.testing.demos``): the expected time said first, ``--short`` and
``--fresh``, stages a rerun skips once done, and the checkpoint engine a stopped run resumes from, as a
command-line override the config accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.testing.demos import Expected, Stages, arguments, resume_override, say_expected

ROOT = Path(__file__).resolve().parents[2]


def test_expected_time_and_flags(capsys) -> None:
    say_expected(Expected("about 12 min", "about 6 min", "2026-12-02"), short=False)
    line = capsys.readouterr().out
    assert "about 12 min on a 2-core CPU" in line and "--short: about 6 min" in line and "--fresh" in line
    args = arguments(argparse.ArgumentParser()).parse_args(["--short", "--fresh"])
    assert args.short and args.fresh
    assert not hasattr(arguments(argparse.ArgumentParser(), resumable=False).parse_args([]), "fresh")


def test_stages_run_once_and_fresh_starts_over(tmp_path: Path, capsys) -> None:
    ran: list[str] = []
    stages = Stages(tmp_path / "demo", fresh=False)
    stages.run("one", lambda: ran.append("one"))
    (tmp_path / "demo" / "kept.txt").write_text("x")
    Stages(tmp_path / "demo", fresh=False).run("one", lambda: ran.append("again"))
    assert ran == ["one"] and "one: done earlier" in capsys.readouterr().out
    with pytest.raises(ZeroDivisionError):  # a stage that fails is not marked done: the rerun runs it
        Stages(tmp_path / "demo", fresh=False).run("two", lambda: 1 / 0)
    Stages(tmp_path / "demo", fresh=False).run("two", lambda: ran.append("two"))
    Stages(tmp_path / "demo", fresh=True).run("one", lambda: ran.append("fresh"))
    assert ran == ["one", "two", "fresh"] and not (tmp_path / "demo" / "kept.txt").exists()


def test_the_resume_override_adds_a_resuming_checkpoint_engine(tmp_path: Path) -> None:
    config = load_config(ROOT / "examples" / "sft-reverse.yaml", [resume_override(tmp_path / "run", 20)])
    engine = config.checkpoint[1]
    assert engine.type == "deepspeed" and engine.auto_resume and engine.save_every_n_steps == 20
    assert Path(engine.output_dir) == tmp_path / "run" / "resume" and engine.save_total_limit == 1


def test_a_demos_child_ends_with_the_demo(tmp_path: Path) -> None:
    """A demo killed by a ``timeout`` (SIGTERM) leaves no ``posttrain`` run behind: its children get SIGTERM
    when it dies (on which a training run saves and stops)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    demo = tmp_path / "demo.py"
    demo.write_text(
        f"import sys\nfrom posttrain.testing import demos\ndemos.run([sys.executable, '-c', {child_code!r}])\n"
    )
    parent = subprocess.Popen(
        [sys.executable, str(demo)], env={**os.environ, "PYTHONPATH": str(ROOT / "src")}
    )
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline and parent.poll() is None
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)
    parent.wait(timeout=30)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the demo's child outlived it")
