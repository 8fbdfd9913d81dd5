"""The sandbox's launcher (``sandbox.confine``): run by a fresh ``python -I``, it builds the confinement, then
the program replaces its last process (``os.execv``), which keeps every part of it. Standard library only:
nothing of the training process's packages loads before the confinement holds.

Three processes: the launcher (L) joins the run's cgroups (memory and processes per run, made by the parent)
and sets the resource limits; its child (N) leaves for new user, mount, PID, IPC, network and UTS
namespaces; L, still outside, maps N's root to an unprivileged user (``nobody`` when L is root, else L's own
user) and tells N to go on; N's child (P) is process 1 of the new PID namespace: it builds a root file system
of its own (a size-limited tmpfs holding the program's directory, ``/tmp`` and ``/dev/shm``; the system and
Python's directories bound read-only; four devices; a fresh ``/proc``), switches to it, forbids new user
namespaces, drops every capability, sets ``no_new_privs``, adds Landlock's rules where the kernel has them
and becomes the program. P's host PID goes to the parent on a pipe, so the parent can end the whole
namespace (killing process 1 of a PID namespace kills everything in it) even if the program left L's process
group. The program's output goes to the parent's pipes, never to files.

Where the kernel makes no user namespace (an old kernel, a container that forbids them) and the run accepts
less (``strict`` false), L runs the program itself in ``workdir`` on the host, with the resource limits, a
clean environment and, where the kernel has Landlock, writes only there, no TCP and no signals out.

Arguments: two file descriptors: one to read the JSON spec from (``cpu`` s, ``memory`` bytes of address
space per process, ``file_size``, ``processes``, ``disk`` bytes of the tmpfs, ``cgroups`` to join, ``binds``
read-only directories, ``root`` an empty directory to build the new root on, ``workdir`` the host directory of
the fallback, ``program`` argv after the interpreter, ``files`` name -> text for the program's directory,
``strict``), one to write what held to (JSON lines: ``held``, ``pid``, ``failed``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SYS_PIVOT_ROOT, SYS_CAPSET = 155, 126
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
PATH_BENEATH = 1
WRITE_FILE = 1 << 1
_WRITES = WRITE_FILE | sum(1 << bit for bit in range(4, 13))
REFER, TRUNCATE = 1 << 13, 1 << 14
BIND_TCP, CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
NOBODY = 65534
DEVICES = ("null", "zero", "urandom", "random")
MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
#: per architecture: the seccomp audit value and the numbers of the system calls the filter looks at
SYSCALLS = {
    "x86_64": {
        "arch": 0xC000003E, "keyctl": 250, "add_key": 248, "request_key": 249, "socket": 41,
        "socketpair": 53, "io_uring_setup": 425,
    },
    "aarch64": {
        "arch": 0xC00000B7, "keyctl": 219, "add_key": 217, "request_key": 218, "socket": 198,
        "socketpair": 199, "io_uring_setup": 425,
    },
}  # fmt: skip
#: the address families a program may open sockets of (its network namespace has no way out anyway)
FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6


class RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


LIBC = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        LIBC.mount(
            source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )  # fmt: skip


def _locked_flags(path: str) -> int:
    """The flags of the mount holding ``path`` that a user namespace may not clear on a bind of it."""
    found = os.statvfs(path).f_flag
    return (
        (MS_NOSUID if found & os.ST_NOSUID else 0)
        | (MS_NODEV if found & os.ST_NODEV else 0)
        | (MS_NOEXEC if found & os.ST_NOEXEC else 0)
    )


def _bind_read_only(source: str, target: str) -> None:
    """``source`` bound on ``target`` read-only, with every mount under it (a writable submount of a
    read-only directory stays writable otherwise): one ``mount_setattr`` where the kernel has it (5.12), else
    each submount remounted."""
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(
        "none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(source)
    )
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    done = LIBC.syscall(MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, ctypes.byref(attr), 32)
    if done == 0:
        return
    for mounted in _submounts(target):
        _mount(
            "none", mounted, None,
            MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(mounted),
        )  # fmt: skip


def _submounts(target: str) -> list[str]:
    """The mount points strictly under ``target`` (``/proc/self/mountinfo``'s fifth field, octal-escaped)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(target.rstrip("/") + "/"):
                found.append(point)
    return found


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------ P: the program's process


def _new_root(spec: dict) -> None:
    """The program's file system: a tmpfs root (its directory, /tmp, /dev/shm: the disk it may fill), the
    system and Python's directories read-only, four devices, a fresh /proc; the host's tree detached."""
    root = spec["root"]
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk']},mode=0755")
    for name in ("home/sandbox", "tmp", "dev", "dev/shm", "proc", "old"):
        os.makedirs(f"{root}/{name}", exist_ok=True)
    os.chmod(f"{root}/tmp", 0o1777)
    for directory, link, fd in spec["opened"]:
        inside = root + directory
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        if link is not None:  # /bin -> usr/bin on merged systems
            os.symlink(link, inside)
            continue
        os.makedirs(inside, exist_ok=True)
        # through the descriptor L opened: the unprivileged user may not be able to walk to it (/root)
        _bind_read_only(f"/proc/self/fd/{fd}", inside)
        os.close(fd)
    for device in DEVICES:
        inside = f"{root}/dev/{device}"
        open(inside, "w").close()
        _mount(f"/dev/{device}", inside, None, MS_BIND)
    for name, text in spec["files"].items():
        _write(f"{root}/home/sandbox/{name}", text)
    # proc before the host's tree goes: the kernel mounts a new proc only where a whole one is visible
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    _check(LIBC.syscall(SYS_PIVOT_ROOT, b".", b"old"), "pivot_root")
    _check(LIBC.umount2(b"/old", MNT_DETACH), "umount the host's tree")
    os.rmdir("/old")
    os.chdir("/home/sandbox")


def _no_capabilities() -> None:
    """No new user namespaces (the kernel counts them per namespace), then every capability dropped."""
    _write("/proc/sys/user/max_user_namespaces", "0")
    # counted per user namespace and charged to the trainer's user too: the program's share is bounded
    for name, value in (("max_inotify_instances", "16"), ("max_inotify_watches", "4096")):
        with contextlib.suppress(OSError):
            _write(f"/proc/sys/user/{name}", value)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header, data = CapHeader(0x20080522, 0), (CapData * 2)()
    _check(LIBC.syscall(SYS_CAPSET, ctypes.byref(header), ctypes.byref(data)), "capset")
    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _landlock(writable: tuple[str, ...], outside: bool = False) -> list[str]:
    """Writes only under ``writable`` where Landlock exists: a second fence inside the read-only tree; on the
    host (``outside``: no namespaces), also no TCP (ABI 4) and no signals or abstract sockets out (ABI 6)."""
    abi = LIBC.syscall(CREATE_RULESET, None, 0, 1)
    if abi < 1:
        return []
    writes = _WRITES | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    net = (BIND_TCP | CONNECT_TCP) if outside and abi >= 4 else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if outside and abi >= 6 else 0
    attr = RulesetAttr(writes, net, scoped)
    size = ctypes.sizeof(RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = LIBC.syscall(CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return []
    for path in writable:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        allowed = writes if os.path.isdir(path) else WRITE_FILE | (TRUNCATE if abi >= 3 else 0)
        LIBC.syscall(ADD_RULE, ruleset, PATH_BENEATH, ctypes.byref(PathBeneath(allowed, fd)), 0)
        os.close(fd)
    LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if LIBC.syscall(RESTRICT_SELF, ruleset, 0) != 0:
        return []
    held = [
        f"Landlock ABI {abi}: writes only in "
        + ("its directory" if outside else "its directory, /tmp, /dev/shm")
    ]
    if net:
        held.append("no TCP bind or connect (Landlock)")
    if scoped:
        held.append("no signals or abstract sockets outside (Landlock)")
    return held


def _filter_program(table: dict[str, int]) -> list[tuple[int, str | int, str | int, int]]:
    """The seccomp filter as (code, jump if true, jump if false, k) with labels: no keyring calls, no
    io_uring (its sockets would pass the socket rule), sockets of :data:`FAMILIES` only, no other ABI."""
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, errno = 0x7FFF0000, 0x00050000
    steps: list[tuple[int, str | int, str | int, int]] = [
        (load, 0, 0, 4),  # the architecture
        (jeq, 0, "nosys", table["arch"]),
        (load, 0, 0, 0),  # the system call's number
        (jge, "nosys", 0, 0x40000000),  # x32's numbers on x86_64
    ]
    for name in ("keyctl", "add_key", "request_key", "io_uring_setup"):
        steps.append((jeq, "refuse", 0, table[name]))
    steps += [
        (jeq, "family", 0, table["socket"]),
        (jeq, "family", 0, table["socketpair"]),
        (ret, 0, 0, allow),
    ]
    steps.append((load, 0, 0, 16))  # "family": the first argument's low 32 bits (an int)
    steps += [(jeq, "allow", 0, family) for family in FAMILIES]
    steps += [
        (ret, 0, 0, errno | 97),  # EAFNOSUPPORT
        (ret, 0, 0, allow),  # "allow"
        (ret, 0, 0, errno | 1),  # "refuse": EPERM
        (ret, 0, 0, errno | 38),  # "nosys": ENOSYS
    ]
    return steps


def _seccomp() -> list[str]:
    """A fresh, empty session keyring (not the trainer's), then the filter of :func:`_filter_program`; what
    held. An architecture without a table gets neither (said by its absence in ``posttrain sandbox check``)."""
    table = SYSCALLS.get(os.uname().machine)
    if table is None:
        return []
    held = []
    if LIBC.syscall(table["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) >= 0:
        held.append("a session keyring of its own")
    steps = _filter_program(table)
    family = next(i for i, (code, _, _, k) in enumerate(steps) if code == 0x20 and k == 16)
    labels = {"family": family, "allow": len(steps) - 3, "refuse": len(steps) - 2, "nosys": len(steps) - 1}
    program = (SockFilter * len(steps))()
    for index, (code, true, false, k) in enumerate(steps):
        jt = labels[true] - index - 1 if isinstance(true, str) else true
        jf = labels[false] - index - 1 if isinstance(false, str) else false
        program[index] = SockFilter(code, jt, jf, k)
    fprog = SockFprog(len(steps), program)
    LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
    return [*held, "no keyring calls, no io_uring, sockets of Unix and IP families only (seccomp)"]


def program(spec: dict, held: list[str], report: int) -> None:
    """P: process 1 of the new PID namespace, which becomes the program."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        _check(LIBC.sethostname(b"sandbox", 7), "sethostname")
        _new_root(spec)
        held.append("its own root: system and Python read-only, a private /tmp and /dev/shm, a fresh /proc")
        held.append(f"disk: {spec['disk']} bytes in all (tmpfs)")
        _no_capabilities()
        held.append("no capabilities, no new privileges, no new user namespaces")
    except Exception as error:  # whatever stops the confinement stops the run, with its reason
        os.write(report, json.dumps({"failed": f"{type(error).__name__}: {error}"}).encode() + b"\n")
        os._exit(125)
    held += _landlock(("/home/sandbox", "/tmp", "/dev/shm", "/dev/null"))
    # counted per user namespace: a second fence behind the run's pids cgroup
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["processes"], spec["processes"]))
    try:
        held += _seccomp()
    except OSError as error:
        os.write(report, json.dumps({"failed": f"{type(error).__name__}: {error}"}).encode() + b"\n")
        os._exit(125)
    # what the parent checks against what it requires (confine.REQUIRED): names, not the sentences above
    guarantees = ["namespaces", "own_root", "disk", "no_capabilities"]
    os.write(report, json.dumps({"held": held, "guarantees": guarantees}).encode() + b"\n")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/home/sandbox",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    os.execve(sys.executable, [sys.executable, "-I", "-u", *spec["program"]], env)


# ------------------------------------------------------------------------------ N and L


def _wait(pid: int) -> int:
    """The exit status of ``pid`` as a shell gives it (128 + signal)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def namespaces(spec: dict, go: int, ready: int, report: int) -> None:
    """N: new namespaces; once L has mapped its users, the program's process (P) is its child."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
    unshared = LIBC.unshare(flags) == 0
    os.write(ready, b"1" if unshared else b"0")
    os.close(ready)
    answer = os.read(go, 1)
    os.close(go)
    if answer != b"1":
        os._exit(125)
    # opened in the new mount namespace (which P shares), while N is still the trainer's user outside, who
    # may walk to them (/root)
    spec["opened"] = open_binds(spec["binds"])
    os.setresgid(0, 0, 0)  # become the namespace's root: the unprivileged user outside
    os.setresuid(0, 0, 0)
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a change of user clears it: set again
    held = ["user (mapped to an unprivileged user)", "mount", "PID", "IPC", "network", "UTS"]
    child = os.fork()
    if child == 0:
        program(spec, [f"namespaces: {', '.join(held)}"], report)
    os.write(report, json.dumps({"pid": child}).encode() + b"\n")
    os.close(report)
    os._exit(_wait(child))


def _map_users(pid: int) -> None:
    """Root of the new user namespace is ``nobody`` outside when the launcher is root, else its own user."""
    uid, gid = os.getuid(), os.getgid()
    outside_uid, outside_gid = (NOBODY, NOBODY) if uid == 0 else (uid, gid)
    _write(f"/proc/{pid}/setgroups", "deny")
    _write(f"/proc/{pid}/uid_map", f"0 {outside_uid} 1")
    _write(f"/proc/{pid}/gid_map", f"0 {outside_gid} 1")


def limits(spec: dict) -> list[str]:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu"], spec["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory"], spec["memory"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_size"], spec["file_size"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["files_open"], spec["files_open"]))
    held = ["CPU time per process", "memory per process", "file size", "open files per process"]
    for group in spec["cgroups"]:
        _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
    return held


def _reachable_by_others(path: str) -> bool:
    """Whether a user with no relation to the file's owners may run ``path`` (each directory on its way
    searchable by others, the file executable by others)."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for end in range(2, len(parts)):
        if not os.stat("/".join(parts[:end])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o001)


def on_the_host(spec: dict, held: list[str], report: int) -> None:
    """No namespaces here, and the run accepts that: the program in its host directory, with the limits."""
    os.makedirs(spec["workdir"], mode=0o700)
    os.chdir(spec["workdir"])
    for name, text in spec["files"].items():
        _write(name, text)
    if os.getuid() == 0 and _reachable_by_others(sys.executable):  # not root: nobody, who owns only this
        for path in [spec["workdir"], *spec["files"]]:
            os.chown(path, NOBODY, NOBODY)
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        held.append("runs as nobody")
    held += _landlock((spec["workdir"], "/dev/null"), outside=True)
    held += _seccomp()
    if os.getuid() == 0:
        held.append("runs as the trainer's root (its Python is not reachable by nobody)")
    os.write(report, json.dumps({"held": held, "pid": os.getpid()}).encode() + b"\n")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": spec["workdir"],
        "TMPDIR": spec["workdir"],
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    os.execve(sys.executable, [sys.executable, "-I", "-u", *spec["program"]], env)


def open_binds(directories: list[str]) -> list[tuple[str, str | None, int]]:
    """The read-only directories as the trainer's user sees them: a symlink's target, or a descriptor."""
    opened = []
    for directory in directories:
        if os.path.islink(directory):
            opened.append((directory, os.readlink(directory), -1))
        elif os.path.isdir(directory):
            opened.append((directory, None, os.open(directory, os.O_PATH | os.O_DIRECTORY)))
    return opened


def on_the_host_or_fail(spec: dict, held: list[str], report: int) -> None:
    try:
        on_the_host(spec, held, report)
    except Exception as error:  # the program never starts without the limits it was given
        os.write(report, json.dumps({"failed": f"{type(error).__name__}: {error}"}).encode() + b"\n")
        os._exit(125)


def main() -> None:
    # SIGTERM/SIGINT are the training process's (SLURM signals every process of the job, a terminal the
    # group): a program killed by them would score as a failure in the step the stop is finishing. The
    # program inherits the ignored signals; the sandbox ends it with SIGKILL at its time limit.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # whoever started it (a reward worker, the trainer, the command) dies: so does the launcher, then its
    # child and the program's process 1 (each set the same), which ends the program's whole namespace
    parent = os.getppid()
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the setting took
        os._exit(125)
    with os.fdopen(int(sys.argv[1]), "rb") as source:
        spec = json.loads(source.read())
    report = int(sys.argv[2])
    os.set_inheritable(report, False)  # closed by the program's exec; open to say why an exec failed
    held = limits(spec)
    if not spec["namespaces"]:
        on_the_host_or_fail(spec, held, report)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        os.close(go_w)
        namespaces(spec, go_r, ready_w, report)
    os.close(ready_w)
    os.close(go_r)
    unshared = os.read(ready_r, 1) == b"1"
    if unshared:
        try:
            _map_users(child)
        except OSError:
            unshared = False
    if not unshared:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        if not spec["strict"]:
            on_the_host_or_fail(spec, held, report)
        os.write(report, json.dumps({"failed": "the kernel made no user namespace here"}).encode() + b"\n")
        os._exit(125)
    os.write(report, json.dumps({"held": held}).encode() + b"\n")
    os.close(report)
    os.write(go_w, b"1")
    os.close(go_w)
    os._exit(_wait(child))


if __name__ == "__main__":
    main()
