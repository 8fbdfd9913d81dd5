"""A sandbox for model-written code: the ``code_tests`` reward and the ``python`` tool run it here.

Each run is a child process (``python -I``: no user site, no ``PYTHON*`` variables) in a fresh temporary
directory, removed after, with an environment of its own (``PATH``, ``HOME`` and ``TMPDIR`` in its directory,
``LANG``: none of the parent's variables, so no secrets), its output in files of that directory (at most
``file_size`` bytes each), and these limits, applied by ``sandbox_child`` before the code starts:

- wall time: the whole process group is killed after ``wall`` seconds (and in any case when the run ends, so
  nothing it started survives);
- CPU time (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``), no core files;
- processes (``RLIMIT_NPROC``, counted in its own user namespace);
- network: a network namespace of its own (no interface but a loopback that is down, so not even the
  machine's 127.0.0.1), where the kernel allows unprivileged user namespaces; and Landlock's TCP rules (ABI 4,
  Linux 6.7+) where available;
- file system: Landlock (Linux 5.13+): it writes under its directory and ``/dev/null`` only; it reads what the
  user may read (the interpreter and its libraries), except other processes' memory and environment, which
  Landlock's ptrace rule keeps from it.

``enforced()`` says which of these hold on this machine (it runs the launcher once); a machine without user
namespaces or Landlock (an old kernel, a container that forbids them) keeps the limits, the clean environment
and the directory, not the network or file-system confinement.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass(frozen=True)
class Limits:
    wall: float = 10.0  # seconds
    cpu: int = 10  # seconds
    memory: int = 512 * 2**20  # bytes of address space
    processes: int = 32
    file_size: int = 16 * 2**20  # bytes per file written, its output included
    output: int = 8192  # characters of output kept


@dataclass
class Ran:
    """A sandboxed run: exit code (negative: the signal that ended it), its output, whether the wall clock
    stopped it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def run_python(code: str, limits: Limits = Limits(), stdin: str = "", report: bool = False) -> Ran:
    """Run ``code`` as a Python program in the sandbox (see the module docstring)."""
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    started = time.perf_counter()
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        spec = {
            "cpu": max(1, int(limits.cpu)),
            "memory": int(limits.memory),
            "file_size": int(limits.file_size),
            "processes": int(limits.processes),
            "workdir": workdir,
            "program": ["main.py"],
            "cgroup": str(group) if (group := pids_cgroup(limits.processes)) else None,
        }
        out_path, err_path = Path(workdir, ".stdout"), Path(workdir, ".stderr")
        with out_path.open("wb") as out, err_path.open("wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-I", str(CHILD), *(["--report"] if report else []), json.dumps(spec)],
                cwd=workdir,
                env=_environment(workdir),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: killed whole
            )
            timed_out = False
            try:
                process.communicate(stdin.encode(), timeout=limits.wall)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process.pid)
                process.wait()
                _remove_cgroup(spec["cgroup"])
        return Ran(
            process.returncode,
            _read(out_path, limits.output),
            _read(err_path, limits.output),
            timed_out,
            time.perf_counter() - started,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def pids_cgroup(limit: int) -> Path | None:
    """A fresh pids cgroup limited to ``limit`` processes, where this process may make one (root with
    cgroup v1's pids hierarchy, or a cgroup v2 tree that delegates pids); None elsewhere (RLIMIT_NPROC then
    counts, except for root)."""
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        try:
            if root == Path("/sys/fs/cgroup") and "pids" not in (root / "cgroup.subtree_control").read_text():
                continue
            group = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=root))
        except OSError:
            continue
        try:
            (group / "pids.max").write_text(str(limit))
            return group
        except OSError:
            _remove_cgroup(str(group))
    return None


def _remove_cgroup(group: str | None) -> None:
    """Kill whatever is left in the cgroup (a process that left the group by ``setsid``), then remove it."""
    if not group:
        return
    for _ in range(50):
        try:
            pids = [int(x) for x in Path(group, "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.rmdir(group)
            return
        except OSError:
            time.sleep(0.02)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        data = f.read(limit * 4)
    return data.decode("utf-8", errors="replace")[:limit]


@functools.cache
def enforced() -> str:
    """What the sandbox enforces on this machine, in words (the launcher's own report)."""
    ran = run_python("pass", Limits(wall=30), report=True)
    line = next((x for x in ran.stderr.splitlines() if x.startswith("confined: ")), "")
    return line.removeprefix("confined: ") + ", wall time, clean environment, temporary directory"


# ------------------------------------------------------------------------------------------ the tool


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints.

    Args:
        code: the Python program to run
    """
    ran = run_python(code)
    text = ran.stdout + (ran.stderr if ran.stderr else "")
    if ran.timed_out:
        text += f"\n(stopped: it ran past {Limits().wall:g} s)"
    elif ran.returncode < 0:
        text += f"\n(killed by signal {-ran.returncode})"
    return text.strip() or "(no output)"


# --------------------------------------------------------------------------------- the code reward

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_MARK = "__posttrain_tests__"


def last_code_block(text: str) -> str | None:
    """The last fenced code block (```python ... ```) of a completion."""
    found = _BLOCK.findall(text)
    return found[-1] if found else None


def tests_program(code: str, tests: list[str]) -> str:
    """The code, then each test (a statement, usually an ``assert``) run in its namespace, its result counted."""
    return (
        code
        + "\n\n"
        + "def "
        + _MARK
        + "(tests):\n"
        + "    passed = 0\n"
        + "    for test in tests:\n"
        + "        try:\n"
        + "            exec(test, globals())\n"
        + "            passed += 1\n"
        + "        except BaseException:\n"
        + "            pass\n"
        + f"    print('{_MARK}', passed, len(tests), flush=True)\n"
        + f"{_MARK}({json.dumps(tests)})\n"
    )


def tests_passed(code: str | None, tests: list[str], limits: Limits) -> float:
    """The share of ``tests`` the code passes in the sandbox (0 without code, or when it does not finish)."""
    if not code or not tests:
        return 0.0
    ran = run_python(tests_program(code, tests), limits)
    found = [line.split() for line in ran.stdout.splitlines() if line.startswith(_MARK)]
    if ran.timed_out or not found or len(found[-1]) != 3:
        return 0.0
    passed, total = int(found[-1][1]), int(found[-1][2])
    return passed / total if total == len(tests) else 0.0
