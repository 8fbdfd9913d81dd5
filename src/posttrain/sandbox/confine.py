"""A sandbox for model-written code: the ``code_tests`` reward and the ``python`` tool run it here, and
``posttrain sandbox`` runs it for a user.

Each run is a launcher process (``sandbox.child``) that builds, before the program starts:

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

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import UserError

CHILD = Path(__file__).with_name("child.py")
LAUNCH_FAILED = 125
#: open files per process of the program (RLIMIT_NOFILE): with the processes' limit, its share of the host's
#: file table
FILES_OPEN = 256


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
    #: the names (:data:`REQUIRED`'s keys) of the confinements that held, as the launcher and cgroups reported
    guarantees: frozenset[str] = frozenset()

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class SandboxError(UserError):
    """The sandbox could not be built (the launcher says why)."""


# ---------------------------------------------------------------------------------- the run's cgroups


def _own_v1(controller: str) -> Path | None:
    """This process's cgroup in a v1 hierarchy (``/proc/self/cgroup``'s ``N:memory:/path``)."""
    root = Path("/sys/fs/cgroup") / controller
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            if controller in names.split(","):
                return root / path.strip("/")
    return None


def _cgroup_v1(controller: str, settings: dict[str, str]) -> Path | None:
    """A child of this process's v1 cgroup (so under the job's own limit), else of the hierarchy's root."""
    root = Path("/sys/fs/cgroup") / controller
    for parent in dict.fromkeys(p for p in (_own_v1(controller), root) if p is not None):
        _sweep(parent)
        try:
            group = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=parent))
            break
        except OSError:
            continue
    else:
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
        _sweep(parent)
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


_SWEPT: set[Path] = set()
#: an empty run cgroup older than this is one whose starter died (a run's launcher joins its own in ms)
STALE_S = 60.0


def _sweep(parent: Path) -> None:
    """Once per process and parent: remove the empty run cgroups a killed trainer left (the sandboxes in them
    died with it: each launcher dies with its starter)."""
    if parent in _SWEPT:
        return
    _SWEPT.add(parent)
    with contextlib.suppress(OSError):
        for group in parent.glob("posttrain-sandbox-*"):
            with contextlib.suppress(OSError):
                if time.time() - group.stat().st_mtime > STALE_S and not (group / "cgroup.procs").read_text():
                    os.rmdir(group)


def run_cgroups(limits: Limits) -> tuple[list[Path], list[str], set[str]]:
    """The cgroups that hold the run's memory and processes, what they limit (said, and as
    :data:`REQUIRED`'s names)."""
    if (group := _cgroup_v2(limits)) is not None:
        return (
            [group],
            ["memory per run (cgroup v2)", "processes per run (cgroup v2)"],
            {"memory_per_run", "processes_per_run"},
        )
    groups, held, guarantees = [], [], set()
    memory = _cgroup_v1(
        "memory",
        {"memory.limit_in_bytes": str(limits.memory), "memory.memsw.limit_in_bytes": str(limits.memory)},
    )
    if memory is not None:
        groups.append(memory)
        held.append("memory per run (cgroup)")
        guarantees.add("memory_per_run")
    pids = _cgroup_v1("pids", {"pids.max": str(limits.processes)})
    if pids is not None:
        groups.append(pids)
        held.append("processes per run (cgroup)")
        guarantees.add("processes_per_run")
    return groups, held, guarantees


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


class Launched:
    """A sandboxed program started (:func:`launched`): its process with the parent's ends of its pipes
    (``stdin``, ``stdout``, ``stderr``), and the launcher's report (what held, the program's PID)."""

    def __init__(
        self, process: subprocess.Popen, report: _Reader, held: list[str], guarantees: set[str]
    ) -> None:
        self.process, self.report, self.held, self.guarantees = process, report, held, guarantees
        self.pidfd: int | None = None
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        """A handle on the program's process 1 as soon as the launcher names it (killing it ends the run)."""
        while self.pidfd is None and self.process.poll() is None:
            self.pidfd = self._pidfd()
            time.sleep(0.005)
        if self.pidfd is None:
            self.pidfd = self._pidfd()

    def _pidfd(self) -> int | None:
        """A handle on the program's first process (process 1 of its PID namespace) once the launcher sent
        its PID: killing it ends the namespace, whatever the program did to its process group or session."""
        pid = next((note["pid"] for note in self.notes() if "pid" in note), None)
        if pid is not None:
            with contextlib.suppress(OSError, TypeError):
                return os.pidfd_open(pid)
        return None

    def notes(self) -> list[dict[str, Any]]:
        text = self.report.kept.decode(errors="replace")
        found = []
        for line in text.splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return found


@contextlib.contextmanager
def launched(
    code: str,
    limits: Limits = Limits(),
    strict: bool = True,
    files: dict[str, str] | None = None,
    namespaces: bool = True,
) -> Iterator[Launched]:
    """``code`` running as a Python program in the sandbox (see the module docstring) inside the block; at
    its end the whole run is killed and its cgroups and directory removed. ``strict``: refuse to run where
    the kernel makes no namespaces (``SandboxError``), else run on the host with what holds (``namespaces:
    False`` asks for that directly: the tests of the weaker path)."""
    root = tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=sandbox_tmp())  # the new root's mount point
    os.chmod(root, 0o711)  # the weaker path's user (nobody) walks through it to its directory
    groups, held, guarantees = run_cgroups(limits)
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
        "files_open": FILES_OPEN,
        "disk": int(limits.disk),
        "cgroups": [str(g) for g in groups],
        "binds": _binds(),
        "root": root,
        "workdir": os.path.join(root, "host"),  # the program's directory only where it runs on the host
        "program": ["main.py"],
        "files": {"main.py": code, **(files or {})},
        "strict": strict,
        "namespaces": namespaces,
    }
    spec_r, spec_w = os.pipe()
    report_r, report_w = os.pipe()
    process = None
    run: Launched | None = None
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
        report = _Reader(os.fdopen(report_r, "rb", buffering=0), 1 << 20)
        report_r = -1
        report.start()
        run = Launched(process, report, held, guarantees)
        yield run
    finally:
        for fd in (spec_r, spec_w, report_r, report_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if run is not None:
            run.watcher.join(timeout=1)
        _end(process, run.pidfd if run is not None else None, groups)
        remove_tree(root)  # empty, or the weaker path's directory: whatever the program left there
    run.report.join(timeout=2)
    notes = run.notes()
    failed = next((n["failed"] for n in notes if "failed" in n), None)
    if process.returncode == LAUNCH_FAILED and failed:
        raise SandboxError(failed)
    for note in notes:
        run.held += note.get("held", [])
        run.guarantees.update(note.get("guarantees", []))


def run_python(
    code: str,
    limits: Limits = Limits(),
    stdin: str = "",
    strict: bool = True,
    files: dict[str, str] | None = None,
    output_bytes: int | None = None,
    namespaces: bool = True,
) -> Ran:
    """Run ``code`` as a Python program in the sandbox to its end or its wall time: what it printed (the
    first ``output_bytes``, default the limits' output) and how it ended."""
    started = time.perf_counter()
    budget = output_bytes or limits.output * 4
    timed_out = False
    with launched(code, limits, strict, files, namespaces) as run:
        process = run.process
        readers = [_Reader(process.stdout, budget), _Reader(process.stderr, budget)]
        for reader in readers:
            reader.start()
        feeder = threading.Thread(target=_feed, args=(process.stdin, stdin.encode()), daemon=True)
        feeder.start()
        try:
            process.wait(timeout=max(0.0, started + limits.wall - time.perf_counter()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for reader in readers:
        reader.join(timeout=2)
    chars = limits.output if output_bytes is None else output_bytes
    return Ran(
        _exit_code(process.returncode),
        readers[0].text(chars),
        readers[1].text(chars),
        timed_out,
        time.perf_counter() - started,
        run.held,
        frozenset(run.guarantees),
    )


def _feed(stream: Any, data: bytes) -> None:
    with contextlib.suppress(OSError):
        stream.write(data)
    with contextlib.suppress(OSError):
        stream.close()


def _end(process: subprocess.Popen | None, pidfd: int | None, groups: list[Path]) -> None:
    """Kill the program's PID namespace, then the launcher's group and the cgroups' members; reap; never
    raise. Process 1 of the namespace goes first, so the launcher's child and the launcher end by themselves
    and each reaps its own: none is left a zombie to a trainer that is process 1 of a container."""
    if pidfd is not None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(pidfd)
    if process is not None:
        if pidfd is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                process.wait(timeout=2)
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            process.wait(timeout=10)
        if os.getpid() == 1:  # orphans of the launcher's group come to process 1: reap them
            _reap_orphans(process.pid)
    for group in groups:
        _remove_cgroup(group)


def _reap_orphans(group: int) -> None:
    """Reap this process's children that are in process group ``group`` (the launcher's, after it died)."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and int(fields[2]) == group:  # parent, process group
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(int(entry.name), os.WNOHANG)


def sandbox_tmp() -> str:
    """Where a run's empty root directory is made: the temporary directory when every user may walk through
    it (the program's mapped user must reach it: a SLURM job's private TMPDIR is not so), else ``/tmp`` or
    ``/dev/shm``; none: one line."""
    for place in dict.fromkeys((tempfile.gettempdir(), "/tmp", "/dev/shm")):
        if _walkable(place):
            return place
    raise SandboxError(
        f"no directory for the sandbox's root: the temporary directory {tempfile.gettempdir()} and /tmp are "
        "not open for other users to walk through (mode o+x on every directory up to them); set TMPDIR to one"
    )


def _walkable(place: str) -> bool:
    path = os.path.realpath(place)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        return False
    parts = path.split("/")
    try:
        return all(os.stat("/".join(parts[:end]) or "/").st_mode & 0o001 for end in range(1, len(parts) + 1))
    except OSError:
        return False


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

#: what the sandbox must give before model-written code runs (unless the run accepts less), by the names the
#: launcher (``sandbox.child``) and the cgroups report them under
REQUIRED = {
    "namespaces": "namespaces: user, mount, PID, IPC, network (no user namespace here)",
    "own_root": "its own read-only root, private /tmp and /dev/shm, a fresh /proc",
    "no_capabilities": "no capabilities, no new privileges",
    "memory_per_run": "memory per run (a cgroup: root, or a cgroup v2 tree that delegates memory and pids)",
    "processes_per_run": "processes per run (a cgroup, as memory)",
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
    guarantees: frozenset[str] = frozenset()
    try:
        ran = run_python("pass", Limits(wall=30), strict=True)
        held, guarantees = ran.held, ran.guarantees
    except SandboxError as error:
        held = [f"launcher: {error}"]
        with contextlib.suppress(SandboxError):
            ran = run_python("pass", Limits(wall=30), strict=False)
            held, guarantees = ran.held, ran.guarantees
    missing = tuple(line for name, line in REQUIRED.items() if name not in guarantees)
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
    line naming what is missing); with ``accept`` (``sandbox_accept_weaker``), the run goes on with what holds
    and says so. The setting reaches the sandbox as an argument: the ``python`` tool's
    (``sandbox/python_tool.py``) and the ``code_tests`` reward's ``strict``."""
    from posttrain.logs import say

    found = require(accept)
    if found.missing:
        say(f"sandbox: running model-written code without {'; '.join(found.missing)} (sandbox_accept_weaker)")
