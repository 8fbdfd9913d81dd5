"""A sandbox for model-written code: the ``code_tests`` reward and the ``python`` tool run it here, and
``posttrain sandbox`` runs it for a user.

Each run is a launcher process (``sandbox_child``) that builds, before the program starts:

- namespaces of its own: user (its root is ``nobody`` outside when the trainer is root, else the trainer's
  user), mount, PID, IPC, network (a loopback that is down), UTS;
- its own root file system: a tmpfs of ``disk`` bytes holding the program's directory, ``/tmp`` and
  ``/dev/shm``; the system's and Python's directories bound read-only (so no write and no change of metadata,
  mode, times, attributes or set-user-ID bits anywhere else); ``/dev/null``, ``zero``, ``random``,
  ``urandom``; a fresh ``/proc`` that shows its own processes only; nothing else of the host (no ``/home``,
  ``/run``, the host's ``/tmp`` or ``/dev/shm``, no Unix socket of the host);
- no capabilities, ``no_new_privs``, no further user namespaces, and Landlock's write rules where the kernel
  has them;
- limits: memory and processes for the whole run (a cgroup the trainer makes: v1's memory and pids
  hierarchies as root, or a cgroup v2 tree that delegates both), CPU seconds, address space and file size per
  process, wall time for the whole run.

The program's output comes back through pipes the parent holds (read as it is written, so what it printed
before a timeout is kept, and nothing it does to its directory changes what the parent reads). At the end,
process 1 of its PID namespace is killed, which ends every process the program started, wherever it moved;
the tmpfs disappears with the namespace, so there is nothing to delete on the host.

``code_tests`` evaluates in the sandbox only the parts of each test that use the program's names and compares
outside: a test ``assert f(2) == 4`` sends ``f(2)`` in, gets its value back as plain data (builtin types only:
an object that says it equals everything is not one), and the parent compares it with ``4``, which never
enters the sandbox. Setup statements and assertions that are not a top-level comparison run inside.

``confinement()`` says what holds on this machine (it runs the launcher once); ``require()`` refuses the
sandbox in one line naming what is missing unless the run accepts less (``sandbox_accept_weaker``), in which
case a machine without user namespaces runs the program on the host with the limits, a clean environment
and Landlock where it exists.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import math
import operator
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import UserError

CHILD = Path(__file__).with_name("sandbox_child.py")
LAUNCH_FAILED = 125


@dataclass(frozen=True)
class Limits:
    wall: float = 10.0  # seconds, the whole run
    cpu: int = 10  # seconds per process
    memory: int = 512 * 2**20  # bytes: the whole run (cgroup) and each process's address space
    processes: int = 32  # at once, the whole run
    disk: int = 64 * 2**20  # bytes of its file system (its directory, /tmp, /dev/shm)
    file_size: int = 16 * 2**20  # bytes per file written
    output: int = 8192  # characters of output kept


@dataclass
class Ran:
    """A sandboxed run: exit code (negative: the signal that ended it), its output, whether the wall clock
    stopped it, and what confined it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    held: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class SandboxError(RuntimeError):
    """The sandbox could not be built (the launcher says why)."""


# ---------------------------------------------------------------------------------- the run's cgroups


def _cgroup_v1(controller: str, settings: dict[str, str]) -> Path | None:
    root = Path("/sys/fs/cgroup") / controller
    try:
        group = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=root))
    except OSError:
        return None
    try:
        for name, value in settings.items():
            with contextlib.suppress(FileNotFoundError):  # memsw exists only with swap accounting
                (group / name).write_text(value)
        return group
    except OSError:
        _remove_cgroup(group)
        return None


def _cgroup_v2(limits: Limits) -> Path | None:
    """A child of this process's cgroup v2 (or of the root) where memory and pids are delegated."""
    base = Path("/sys/fs/cgroup")
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
    except (OSError, StopIteration):
        return None
    for parent in (base / line[3:].strip("/"), base):
        try:
            if not {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split()):
                continue
            group = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=parent))
        except OSError:
            continue
        try:
            (group / "memory.max").write_text(str(limits.memory))
            with contextlib.suppress(FileNotFoundError):
                (group / "memory.swap.max").write_text("0")
            (group / "pids.max").write_text(str(limits.processes))
            return group
        except OSError:
            _remove_cgroup(group)
    return None


def run_cgroups(limits: Limits) -> tuple[list[Path], list[str]]:
    """The cgroups that hold the run's memory and processes, and what they limit."""
    if (group := _cgroup_v2(limits)) is not None:
        return [group], ["memory per run (cgroup v2)", "processes per run (cgroup v2)"]
    groups, held = [], []
    memory = _cgroup_v1(
        "memory",
        {"memory.limit_in_bytes": str(limits.memory), "memory.memsw.limit_in_bytes": str(limits.memory)},
    )
    if memory is not None:
        groups.append(memory)
        held.append("memory per run (cgroup)")
    pids = _cgroup_v1("pids", {"pids.max": str(limits.processes)})
    if pids is not None:
        groups.append(pids)
        held.append("processes per run (cgroup)")
    return groups, held


def _remove_cgroup(group: Path) -> None:
    """Kill what is left in the cgroup, then remove it (a few tries: the kernel frees it after the kills)."""
    for _ in range(100):
        with contextlib.suppress(OSError):
            if (group / "cgroup.kill").exists():
                (group / "cgroup.kill").write_text("1")
        try:
            pids = [int(x) for x in (group / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


# ------------------------------------------------------------------------------------------- the run


def _binds() -> list[str]:
    """The host directories the program sees, read-only: the system's and this Python's."""
    found = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc"]
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        resolved = os.path.realpath(prefix)
        if not any(resolved == d or resolved.startswith(d + "/") for d in found):
            found.append(resolved)
    executable = os.path.dirname(os.path.realpath(sys.executable))
    if not any(executable == d or executable.startswith(d + "/") for d in found):
        found.append(executable)
    return found


class _Reader(threading.Thread):
    """Drains one pipe as the program writes it, keeping the first ``limit`` bytes."""

    def __init__(self, stream: Any, limit: int) -> None:
        super().__init__(daemon=True)
        self.stream, self.limit, self.kept = stream, limit, bytearray()

    def run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            read = getattr(self.stream, "read1", self.stream.read)
            while chunk := read(65536):
                if len(self.kept) < self.limit:
                    self.kept += chunk[: self.limit - len(self.kept)]

    def text(self, chars: int) -> str:
        return self.kept.decode("utf-8", errors="replace")[:chars]


def _exit_code(code: int) -> int:
    """The launcher's exit status as the program's: 128 + N (a signal, as a shell gives it) is -N."""
    return -(code - 128) if 128 < code < 160 else code


def run_python(
    code: str,
    limits: Limits = Limits(),
    stdin: str = "",
    strict: bool = True,
    files: dict[str, str] | None = None,
    output_bytes: int | None = None,
    namespaces: bool = True,
) -> Ran:
    """Run ``code`` as a Python program in the sandbox (see the module docstring). ``strict``: refuse to run
    where the kernel makes no namespaces (``SandboxError``), else run on the host with what holds
    (``namespaces: False`` asks for that directly: the tests of the weaker path)."""
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="posttrain-sandbox-")  # empty on the host: the new root's mount point
    os.chmod(root, 0o711)  # the weaker path's user (nobody) walks through it to its directory
    workdir = os.path.join(root, "host")  # the program's directory only where it runs on the host
    groups, held = run_cgroups(limits)
    if strict and namespaces and not groups:  # never without them, silently: the run asked for them
        shutil.rmtree(root, ignore_errors=True)
        raise SandboxError(
            "the run's cgroups (memory and processes per run) could not be made for this program: it does "
            "not run without them (free cgroups under /sys/fs/cgroup, or set sandbox_accept_weaker: true to "
            "run with what holds)"
        )
    spec = {
        "cpu": max(1, math.ceil(limits.cpu)),
        "memory": int(limits.memory),
        "file_size": int(limits.file_size),
        "processes": int(limits.processes),
        "disk": int(limits.disk),
        "cgroups": [str(g) for g in groups],
        "binds": _binds(),
        "root": root,
        "workdir": workdir,
        "program": ["main.py"],
        "files": {"main.py": code, **(files or {})},
        "strict": strict,
        "namespaces": namespaces,
    }
    spec_r, spec_w = os.pipe()
    report_r, report_w = os.pipe()
    pidfd: int | None = None
    process = None
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", str(CHILD), str(spec_r), str(report_w)],
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(spec_r, report_w),
            start_new_session=True,
        )
        os.close(spec_r)
        os.close(report_w)
        spec_r = report_w = -1
        with os.fdopen(spec_w, "wb") as out:
            spec_w = -1
            out.write(json.dumps(spec).encode())
        budget = output_bytes or limits.output * 4
        readers = [_Reader(process.stdout, budget), _Reader(process.stderr, budget)]
        report = _Reader(os.fdopen(report_r, "rb", buffering=0), 1 << 20)
        report_r = -1
        for reader in (*readers, report):
            reader.start()
        feeder = threading.Thread(target=_feed, args=(process.stdin, stdin.encode()), daemon=True)
        feeder.start()
        deadline = started + limits.wall
        timed_out = False
        while process.poll() is None:
            if pidfd is None:
                pidfd = _program_pidfd(report.kept)
            if time.perf_counter() > deadline:
                timed_out = True
                break
            time.sleep(0.005)
        if pidfd is None:
            pidfd = _program_pidfd(report.kept)
    finally:
        for fd in (spec_r, spec_w, report_r, report_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        _end(process, pidfd, groups)
        remove_tree(root)  # empty, or the weaker path's directory: whatever the program left there
    for reader in (*readers, report):
        reader.join(timeout=2)
    notes = [
        json.loads(line) for line in report.kept.decode(errors="replace").splitlines() if line.startswith("{")
    ]
    failed = next((n["failed"] for n in notes if "failed" in n), None)
    if process.returncode == LAUNCH_FAILED and failed:
        raise SandboxError(failed)
    for note in notes:
        held += note.get("held", [])
    chars = limits.output if output_bytes is None else output_bytes
    return Ran(
        _exit_code(process.returncode),
        readers[0].text(chars),
        readers[1].text(chars),
        timed_out,
        time.perf_counter() - started,
        held,
    )


def _feed(stream: Any, data: bytes) -> None:
    with contextlib.suppress(OSError):
        stream.write(data)
    with contextlib.suppress(OSError):
        stream.close()


def _program_pidfd(report: bytes) -> int | None:
    """A handle on the program's first process (process 1 of its PID namespace) once the launcher sent its
    PID: killing it ends the namespace, whatever the program did to its process group or session."""
    for line in bytes(report).decode(errors="replace").splitlines():
        if line.startswith("{") and '"pid"' in line:
            with contextlib.suppress(ValueError, OSError):
                return os.pidfd_open(json.loads(line)["pid"])
    return None


def _end(process: subprocess.Popen | None, pidfd: int | None, groups: list[Path]) -> None:
    """Kill the program's PID namespace, the launcher's group and the cgroups' members; reap; never raise."""
    if pidfd is not None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(pidfd)
    if process is not None:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            process.wait(timeout=10)
    for group in groups:
        _remove_cgroup(group)


def remove_tree(path: str) -> None:
    """Remove a directory tree without recursion and without paths (so no depth or path length stops it),
    never raising: what cannot be removed stays."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    stack = [(top, None)]  # (directory fd, name of the entry in its parent)
    while stack:
        fd, _ = stack[-1]
        descended = False
        try:
            entries = list(os.scandir(fd))
        except OSError:
            entries = []
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    child = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    stack.append((child, entry.name))
                    descended = True
                    break
                os.unlink(entry.name, dir_fd=fd)
            except OSError:
                continue
        if descended:
            continue
        fd, name = stack.pop()
        with contextlib.suppress(OSError):
            os.close(fd)
        if stack and name is not None:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=stack[-1][0])
    with contextlib.suppress(OSError):
        os.rmdir(path)


# ------------------------------------------------------------------------------- what holds here

#: what the sandbox must give before model-written code runs (unless the run accepts less)
REQUIRED = {
    "namespaces": "namespaces: user, mount, PID, IPC, network (no user namespace here)",
    "own root": "its own read-only root, private /tmp and /dev/shm, a fresh /proc",
    "no capabilities": "no capabilities, no new privileges",
    "memory per run": "memory per run (a cgroup: root, or a cgroup v2 tree that delegates memory and pids)",
    "processes per run": "processes per run (a cgroup, as memory)",
    "disk": "disk per run (a tmpfs in its own mount namespace)",
}


@dataclass(frozen=True)
class Confinement:
    held: tuple[str, ...]
    missing: tuple[str, ...]

    def line(self) -> str:
        text = ", ".join(self.held)
        return text + (f"; MISSING: {', '.join(self.missing)}" if self.missing else "")


@functools.cache
def confinement() -> Confinement:
    """What the sandbox holds on this machine (one run of the launcher), and what it lacks."""
    try:
        ran = run_python("pass", Limits(wall=30), strict=True)
        held = ran.held
    except SandboxError as error:
        held = [f"launcher: {error}"]
        with contextlib.suppress(SandboxError):
            held = run_python("pass", Limits(wall=30), strict=False).held
    text = " ".join(held)
    keys = {
        "namespaces": "namespaces:",
        "own root": "its own root",
        "no capabilities": "no capabilities",
        "memory per run": "memory per run",
        "processes per run": "processes per run",
        "disk": "disk:",
    }
    missing = tuple(REQUIRED[name] for name, mark in keys.items() if mark not in text)
    return Confinement(tuple(held), missing)


def require(accept_weaker: bool, key: str = "sandbox_accept_weaker") -> Confinement:
    """The confinement, or one line naming what is missing and how to accept it."""
    found = confinement()
    if found.missing and not accept_weaker:
        raise UserError(
            f"the sandbox for model-written code lacks on this machine: {'; '.join(found.missing)}. Run as a "
            f"user with user namespaces and a delegated cgroup (or as root), or set {key}: true to run "
            "with what holds (posttrain sandbox check lists it)"
        )
    return found


def enforced() -> str:
    """What the sandbox enforces here, in one line (the pre-flight report's)."""
    return confinement().line()


def prepare(accept: bool) -> None:
    """Before a run executes model-written code: the sandbox as this machine gives it, or the run stops (one
    line naming what is missing); with ``accept``, this process and its reward workers run with what holds,
    and say so."""
    from posttrain.logs import say

    found = require(accept)
    accept_weaker(accept)
    if found.missing:
        say(f"sandbox: running model-written code without {'; '.join(found.missing)} (sandbox_accept_weaker)")


# ------------------------------------------------------------------------------------------ the tool


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints.

    Args:
        code: the Python program to run
    """
    ran = run_python(code, strict=not weaker_accepted())
    text = ran.stdout + (ran.stderr if ran.stderr else "")
    if ran.timed_out:
        text += f"\n(stopped: it ran past {Limits().wall:g} s)"
    elif ran.returncode < 0:
        text += f"\n(killed by signal {-ran.returncode})"
    return text.strip() or "(no output)"


#: set in the training process (and so in its reward workers) when the run accepts a weaker sandbox
WEAKER = "POSTTRAIN_SANDBOX_ACCEPT_WEAKER"


def accept_weaker(value: bool) -> None:
    """Whether this process and its children run the sandbox with what holds (``sandbox_accept_weaker``)."""
    if value:
        os.environ[WEAKER] = "1"
    else:
        os.environ.pop(WEAKER, None)


def weaker_accepted() -> bool:
    return os.environ.get(WEAKER) == "1"


# --------------------------------------------------------------------------------- the code reward

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
}


def last_code_block(text: str) -> str | None:
    """The last fenced code block (```python ... ```) of a completion."""
    found = _BLOCK.findall(text)
    return found[-1] if found else None


@dataclass(frozen=True)
class Check:
    """One top-level assertion: sides the parent knows (literals) or the sandbox evaluates (expressions)."""

    op: str | None  # a comparison's name; None: the expression's truth
    sides: tuple[tuple[str, Any], ...]  # ("value", literal) or ("expr", source)


def plan_test(test: str) -> list[tuple[str, Any]]:
    """A test as steps: ``("run", source)`` executed in the sandbox, ``("check", Check)`` compared outside."""
    try:
        module = ast.parse(test)
    except SyntaxError:
        return [("run", test)]  # the sandbox reports the error: the test fails
    steps: list[tuple[str, Any]] = []
    for statement in module.body:
        test_node = statement.test if isinstance(statement, ast.Assert) else None
        if (
            isinstance(test_node, ast.Compare)
            and len(test_node.ops) == 1
            and type(test_node.ops[0]) in _COMPARE
        ):
            sides = tuple(_side(node) for node in (test_node.left, test_node.comparators[0]))
            steps.append(("check", Check(type(test_node.ops[0]).__name__, sides)))
        elif test_node is not None:
            steps.append(("check", Check(None, (_side(test_node),))))
        else:
            steps.append(("run", ast.unparse(statement)))
    return steps


def _side(node: ast.expr) -> tuple[str, Any]:
    try:
        return ("value", ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ("expr", ast.unparse(node))


#: the harness that runs inside: it reads its job before the program's code runs, holds its own references
#: to what it uses, and reports values as plain data (exact builtin types, bounded) on its own lines
HARNESS = r"""
import json as _json, sys as _sys
_read, _write, _type, _repr, _sorted = _sys.stdin.read, _sys.__stdout__.write, type, repr, sorted
_exec, _eval, _compile, _flush, _dict = exec, eval, compile, _sys.__stdout__.flush, dict
_job = _json.loads(_read())
_nonce, _dumps = _job["nonce"], _json.dumps
_PLAIN = (int, float, str, bool, type(None))


def _plain(value, budget=[100000]):
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError("value too large")
    kind = _type(value)
    if kind in _PLAIN:
        return [kind.__name__, _repr(value) if kind is float else value]
    if kind in (list, tuple, set, frozenset):
        items = [_plain(v) for v in value]
        return [kind.__name__, _sorted(items, key=_dumps) if kind in (set, frozenset) else items]
    if kind is dict:
        return ["dict", [[_plain(k), _plain(v)] for k, v in value.items()]]
    raise TypeError("not plain data: " + kind.__name__)


def _say(*fields):
    _write(_dumps([_nonce, *fields]) + "\n")
    _flush()


_names = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    _exec(_compile(_job["code"], "solution.py", "exec"), _names)
    _say("code", True)
except BaseException as _error:
    _say("code", False)
for _index, _steps in enumerate(_job["tests"]):
    _scope = _dict(_names)
    for _number, (_kind, _source) in enumerate(_steps):
        try:
            if _kind == "run":
                _exec(_compile(_source, "test", "exec"), _scope)
                _say(_index, _number, "ran")
            else:
                _say(_index, _number, "value", _plain(_eval(_compile(_source, "test", "eval"), _scope)))
        except BaseException as _error:
            _say(_index, _number, "error", _type(_error).__name__)
            break
"""


def _from_plain(value: Any) -> Any:
    kind, data = value
    if kind == "float":
        return float(data)
    if kind in ("int", "str", "bool", "NoneType"):
        expected = {"int": int, "str": str, "bool": bool, "NoneType": type(None)}[kind]
        if type(data) is not expected:
            raise ValueError(f"not a {kind}")
        return data
    if kind in ("list", "tuple", "set", "frozenset"):
        items = [_from_plain(v) for v in data]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
    if kind == "dict":
        return {_from_plain(k): _from_plain(v) for k, v in data}
    raise ValueError(f"unknown kind {kind!r}")


def tests_passed(code: str | None, tests: list[str], limits: Limits, strict: bool | None = None) -> float:
    """The share of ``tests`` the code passes (0 without code, or when nothing comes back): each test's
    expressions evaluated in the sandbox, its comparisons made here."""
    if not code or not tests:
        return 0.0
    plans = [plan_test(test) for test in tests]
    nonce = secrets.token_hex(16)
    jobs: list[list[tuple[str, str]]] = []
    for plan in plans:
        steps: list[tuple[str, str]] = []
        for kind, step in plan:
            if kind == "run":
                steps.append(("run", step))
            else:
                steps += [("eval", source) for what, source in step.sides if what == "expr"]
        jobs.append(steps)
    job = json.dumps({"nonce": nonce, "code": code, "tests": jobs})
    strict = not weaker_accepted() if strict is None else strict
    ran = run_python(HARNESS, limits, stdin=job, strict=strict, output_bytes=4 << 20)
    answers: dict[tuple[int, int], tuple[str, Any]] = {}
    for line in ran.stdout.splitlines():
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if not isinstance(fields, list) or len(fields) < 4 or fields[0] != nonce or fields[1] == "code":
            continue
        answers.setdefault((fields[1], fields[2]), (fields[3], fields[4] if len(fields) > 4 else None))
    passed = sum(_test_passes(index, plan, answers) for index, plan in enumerate(plans))
    return passed / len(tests)


def _test_passes(index: int, plan: list[tuple[str, Any]], answers: dict[tuple[int, int], Any]) -> bool:
    number = 0
    for kind, step in plan:
        if kind == "run":
            if answers.get((index, number), ("missing",))[0] != "ran":
                return False
            number += 1
            continue
        values = []
        for what, source in step.sides:
            if what == "value":
                values.append(source)
                continue
            answer = answers.get((index, number), ("missing", None))
            number += 1
            if answer[0] != "value":
                return False
            try:
                values.append(_from_plain(answer[1]))
            except (ValueError, TypeError, KeyError):
                return False
        try:
            holds = (
                bool(values[0]) if step.op is None else _COMPARE[getattr(ast, step.op)](values[0], values[1])
            )
        except Exception:  # a comparison of plain values that Python refuses (1 < "a")
            return False
        if not holds:
            return False
    return True
