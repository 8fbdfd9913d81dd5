"""The default suite's guard on its own time, a pytest plugin (tests/conftest.py takes its hooks): it lists
the slowest test modules at the end of a run and fails a run in which a module not listed in
tests/module_times.txt took more than a minute."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: the test modules allowed more than :data:`MODULE_MINUTE` seconds of the default run (set-up, calls and
#: tear-down of its tests together), with the seconds each took in `make test` on this project's 2-core
#: machine (tests/module_times.txt). A module not listed that takes longer fails the run: share its expensive
#: set-up (one model, one training run per module), or mark its slowest tests ``slow``.
MODULE_MINUTE = float(os.environ.get("POSTTRAIN_MODULE_MINUTE", "60"))
MODULE_TIMES = Path(os.environ.get("POSTTRAIN_MODULE_TIMES", Path(__file__).with_name("module_times.txt")))
_module_seconds: dict[str, float] = {}


#: the marks of the tiers outside the default run (make test-slow, make test-vllm, the GPU tests): not counted
OTHER_TIERS = ("slow", "vllm", "gpu")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if any(tier in report.keywords for tier in OTHER_TIERS):
        return
    module = report.nodeid.split("::", 1)[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def _listed_modules() -> dict[str, float]:
    listed = {}
    for line in MODULE_TIMES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, seconds = line.split()
            listed[name] = float(seconds)
    return listed


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Say the slowest modules; fail a run in which a module not listed took more than a minute. Under
    pytest-xdist the controller, which gets every worker's reports, judges; the workers do not."""
    if not _module_seconds or hasattr(session.config, "workerinput"):
        return
    listed = _listed_modules()
    slowest = sorted(_module_seconds.items(), key=lambda item: -item[1])
    over = [(name, seconds) for name, seconds in slowest if seconds > MODULE_MINUTE and name not in listed]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("-", "slowest test modules (seconds, all their tests' set-up, call and tear-down)")
        for name, seconds in slowest[:15]:
            reporter.write_line(
                f"{seconds:8.1f}  {name}" + (f"  (listed: {listed[name]:g})" if name in listed else "")
            )
        for name, seconds in over:
            reporter.write_line(
                f"FAILED: {name} took {seconds:.0f} s (more than {MODULE_MINUTE:g} s) and is not in "
                f"{MODULE_TIMES.name}: share its set-up or mark its slowest tests slow"
            )
    if over and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
