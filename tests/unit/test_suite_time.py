"""The default suite's guard on its own time (tests/suite_time.py): a test module that takes more than a
minute and is not listed in tests/module_times.txt fails the run, naming it; a listed one does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _suite(root: Path, listed: str, *options: str) -> subprocess.CompletedProcess[str]:
    (root / "module_times.txt").write_text(listed)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: the slow tier\n")
    (root / "test_slow_module.py").write_text("import time\n\ndef test_a():\n    time.sleep(0.5)\n")
    (root / "test_marked_slow.py").write_text(  # the `slow` tier (make test-slow): not counted
        "import time\nimport pytest\n\n@pytest.mark.slow\ndef test_b():\n    time.sleep(0.5)\n"
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.suite_time",
            *options,
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={
            **os.environ,
            "PYTHONPATH": str(TESTS.parent),
            "POSTTRAIN_MODULE_MINUTE": "0.2",
            "POSTTRAIN_MODULE_TIMES": str(root / "module_times.txt"),
        },
    )


def test_a_slow_module_not_listed_fails_the_run_and_a_listed_one_does_not(tmp_path: Path) -> None:
    done = _suite(tmp_path, "# none\n")
    assert done.returncode == 1, done.stdout
    assert (
        "FAILED: test_slow_module.py took 1 s (more than 0.2 s) and is not in module_times.txt" in done.stdout
    )
    assert "test_marked_slow.py" not in done.stdout and "2 passed" in done.stdout
    done = _suite(tmp_path, "test_slow_module.py 0.5\n")
    assert done.returncode == 0, done.stdout
    assert "test_slow_module.py  (listed: 0.5)" in done.stdout


def test_under_xdist_the_controller_judges_the_workers_reports(tmp_path: Path) -> None:
    done = _suite(tmp_path, "# none\n", "-n", "2")
    assert done.returncode == 1, done.stdout
    assert done.stdout.count("FAILED: test_slow_module.py took") == 1


def test_tests_sharing_a_module_set_up_run_in_one_worker(tmp_path: Path) -> None:
    """tests/conftest.py groups the tests that share a fixture of module scope; `--dist loadgroup` (make
    test) gives a group to one worker, so its set-up (a training run, a server) is made once."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
    )
    (tmp_path / "test_shared.py").write_text(
        "import os\nimport pytest\n\n"
        "@pytest.fixture(scope='module')\ndef shared():\n    return os.environ['PYTEST_XDIST_WORKER']\n\n"
        + "".join(f"def test_{i}(shared):\n    open('worker-{i}', 'w').write(shared)\n\n" for i in range(6))
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {(tmp_path / f"worker-{i}").read_text() for i in range(6)}
    assert len(workers) == 1, workers
