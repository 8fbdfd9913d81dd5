"""The sandbox's launcher (``rollout.sandbox``): run by a fresh ``python -I``, it confines itself, then
replaces itself with the program (``os.execv``), which keeps every confinement. Standard library only, so that
nothing of the training process's packages loads before the limits apply.

Steps: resource limits (CPU seconds, address space, file size, no core files); a new user and network
namespace (no network device but a loopback that is down) where the kernel allows unprivileged ones; the
process count limit (counted in the new user namespace); Landlock (Linux 5.13+): writes only under the working
directory (and ``/dev/null``), no TCP bind or connect (ABI 4+), no signals to or abstract sockets of processes
outside (ABI 6+). It prints what held to stderr's first line when asked (``--report``).

Argument: a JSON object with ``cpu`` (s), ``memory`` (bytes), ``file_size`` (bytes), ``processes``, ``workdir``,
``program`` (argv after the interpreter), ``cgroup`` (a pids cgroup directory to join, or null).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS = 38
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
RULESET_VERSION = 1
PATH_BENEATH = 1
WRITE_FILE = 1 << 1
#: every right that changes the file system (remove, make char/dir/reg/sock/fifo/block/sym), by ABI: REFER
#: (v2), TRUNCATE (v3)
_WRITES = WRITE_FILE | sum(1 << bit for bit in range(4, 13))
REFER, TRUNCATE = 1 << 13, 1 << 14
BIND_TCP, CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


class RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def new_namespaces(libc: ctypes.CDLL) -> bool:
    """A user namespace (mapping this uid and gid to themselves) with a network namespace of its own."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError:
        pass  # files then belong to the overflow ids; the network is still cut
    return True


def landlock(libc: ctypes.CDLL, workdir: str) -> list[str]:
    """Writes under ``workdir`` only, no TCP, no signals out: what held, by ABI."""
    abi = libc.syscall(CREATE_RULESET, None, 0, RULESET_VERSION)
    if abi < 1:
        return []
    writes = _WRITES | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    attr = RulesetAttr(
        writes,
        (BIND_TCP | CONNECT_TCP) if abi >= 4 else 0,
        (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    size = ctypes.sizeof(RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return []
    for path, allowed in ((workdir, writes), ("/dev/null", WRITE_FILE | (TRUNCATE if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(allowed, fd)
        libc.syscall(ADD_RULE, ruleset, PATH_BENEATH, ctypes.byref(rule), 0)
        os.close(fd)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if libc.syscall(RESTRICT_SELF, ruleset, 0) != 0:
        return []
    held = ["writes only in its directory"]
    if abi >= 4:
        held.append("no TCP bind or connect")
    if abi >= 6:
        held.append("no signals or abstract sockets outside")
    return held


def main() -> None:
    report = "--report" in sys.argv
    spec = json.loads(sys.argv[-1])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu"], spec["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory"], spec["memory"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_size"], spec["file_size"]))
    libc = _libc()
    held = ["CPU time", "memory", "file size"]
    if spec.get("cgroup"):  # a pids cgroup the parent made: the process count, whatever the user
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        held.append("process count (pids cgroup)")
    elif os.getuid() != 0:  # root is exempt from RLIMIT_NPROC, in any namespace
        held.append("process count (RLIMIT_NPROC)")
    if new_namespaces(libc):
        held.append("own network namespace")
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["processes"], spec["processes"]))
    held += landlock(libc, spec["workdir"])
    if report:
        print("confined: " + ", ".join(held), file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-I", *spec["program"]])


if __name__ == "__main__":
    main()
