"""The sandbox against what model-written code tries: every attack a review ran (output files swapped for links
or FIFOs, deleted, buried in 3,000 directories; metadata, mode and set-user-ID changes outside; the host's
System V memory, Unix sockets and /dev/shm; limits escaped by many processes; secrets through /proc; daemons;
output lost at a timeout; a forged code_tests score) and more, each a real program in a real sandbox. Where
this machine cannot give a confinement, the tests of it skip and say so (``posttrain sandbox check``)."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from posttrain.errors import UserError
from posttrain.sandbox import code_tests
from posttrain.sandbox import confine as sandbox
from posttrain.sandbox.confine import Limits, confinement, remove_tree, run_python

LIMITS = Limits(wall=8, cpu=4, memory=256 * 2**20, processes=16, disk=32 * 2**20)
HOLDS = confinement()
FULL = pytest.mark.skipif(bool(HOLDS.missing), reason=f"this machine lacks: {HOLDS.missing}")
# one worker for every test that starts sandboxes: a test here sweeps the machine's idle sandbox cgroups
# at once (STALE_S), which would take another worker's just made ones
pytestmark = pytest.mark.xdist_group("sandboxes")


def run(code: str, limits: Limits = LIMITS, **kwargs) -> sandbox.Ran:
    return run_python(textwrap.dedent(code), limits, **kwargs)


def made_directories(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The temporary directories this process makes from now on (sandboxes other processes run at the same
    time make theirs beside them)."""
    made: list[str] = []
    real = tempfile.mkdtemp

    def recorded(*args: Any, **kwargs: Any) -> str:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    return made


@pytest.fixture
def host_files(tmp_path: Path) -> dict[str, Path]:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    data = tmp_path / "data.jsonl"
    data.write_text('{"a": 1}\n')
    return {"secret": secret, "data": data}


# ------------------------------------------------------------------------------- what holds


def test_this_machine_gives_the_whole_confinement() -> None:
    """On Linux 6.x as root (this project's machines): every required confinement holds; elsewhere the run
    refuses model code unless told to accept less (``test_a_missing_confinement_stops_the_run``)."""
    assert not HOLDS.missing, HOLDS.line()
    for part in (
        "namespaces:",
        "its own root",
        "no capabilities",
        "memory per run",
        "processes per run",
        "disk:",
    ):
        assert part in " ".join(HOLDS.held)


def test_a_missing_confinement_stops_the_run_unless_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    weaker = sandbox.Confinement(("CPU time per process",), (sandbox.REQUIRED["memory_per_run"],))
    monkeypatch.setattr(sandbox, "confinement", lambda: weaker)
    with pytest.raises(
        UserError, match=r"lacks on this machine: memory per run .* sandbox_accept_weaker: true"
    ):
        sandbox.require(False)
    assert sandbox.require(True) is weaker


@FULL
def test_the_program_runs_as_nobody_with_no_capabilities_in_its_own_namespaces() -> None:
    ran = run(
        """
        import os, ctypes
        status = open('/proc/self/status').read()
        libc = ctypes.CDLL(None)
        print(os.getpid(), os.getppid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))
        print(status.split('CapEff:')[1].split()[0], libc.prctl(39, 0, 0, 0, 0))
        print(open('/proc/self/uid_map').read().split())
        print(sorted(os.listdir('/')), os.getcwd(), os.path.exists('/sys'))
        """
    )
    assert ran.ok, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "1 0 ['1']"  # process 1 of its own PID namespace, alone
    assert lines[1] == "0000000000000000 1"  # no capabilities, no_new_privs
    outside = "65534" if os.getuid() == 0 else str(os.getuid())  # the trainer's root is nobody inside
    assert lines[2] == str(["0", outside, "1"])
    # its own root: what the sandbox makes, and the top of each read-only bind (this Python's may be anywhere)
    bound = {d.split("/")[1] for d in sandbox._binds() if os.path.lexists(d)}
    expected = sorted({"dev", "home", "proc", "tmp"} | bound)
    assert lines[3] == f"{expected} /home/sandbox False"


# ------------------------------------------------------------------ output, cleanup and directories


@FULL
@pytest.mark.parametrize(
    "attack",
    [
        # its old output files become links to secrets or FIFOs, or disappear: output travels by pipes
        "import os\nos.symlink('/proc/1/environ', '.stdout')\nos.symlink('/etc/shadow', '.stderr')\nprint('kept')",
        "import os\nos.mkfifo('.stdout')\nos.mkfifo('.stderr')\nprint('kept')",
        "import os, shutil\nfor name in os.listdir('.'):\n    os.remove(name)\nprint('kept')",
        # 3,000 nested directories (deeper than any path the host could walk): the tmpfs goes with the run
        "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('kept')",
    ],
)
def test_what_it_does_to_its_directory_changes_nothing_outside(
    attack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = made_directories(monkeypatch)
    started = time.perf_counter()
    ran = run(attack)
    assert ran.ok and ran.stdout.strip() == "kept", ran
    assert time.perf_counter() - started < 5
    assert made and not [path for path in made if os.path.lexists(path)]  # its root went with it


@FULL
def test_output_before_a_timeout_is_kept_and_a_flood_is_bounded() -> None:
    ran = run("print('partial', flush=True)\nwhile True:\n    pass\n", Limits(wall=1, cpu=10))
    assert ran.timed_out and ran.stdout.startswith("partial")
    flood = run("import sys\nfor _ in range(20000):\n    sys.stdout.write('x' * 10000)\n", LIMITS)
    assert len(flood.stdout) == LIMITS.output and flood.seconds < 8


@FULL
def test_a_background_process_and_a_daemon_end_with_the_run() -> None:
    marker = f"ptd{os.getpid() % 100000}"
    ran = run(
        f"""
        import os, time, ctypes
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)
                time.sleep(60)
            os._exit(0)
        print('started', flush=True)
        """
    )
    assert ran.ok and "started" in ran.stdout
    time.sleep(0.3)
    names = []
    for entry in Path("/proc").iterdir():
        try:
            names.append((entry / "comm").read_text().strip())
        except OSError:
            continue
    assert marker not in names


def test_the_weaker_path_runs_with_limits_and_cleans_any_tree() -> None:
    """Where no namespaces can be made and the run accepts less: the program in a host directory, limited,
    with a clean environment; its directory removed however deep it made it."""
    os.environ["POSTTRAIN_TEST_SECRET"] = "hunter2"
    try:
        ran = run(
            """
            import os
            print(os.environ.get('POSTTRAIN_TEST_SECRET'))
            for _ in range(3000):
                os.mkdir('d')
                os.chdir('d')
            print('deep')
            """,
            strict=False,
            namespaces=False,
        )
    finally:
        del os.environ["POSTTRAIN_TEST_SECRET"]
    assert ran.ok and ran.stdout.split() == ["None", "deep"], ran
    assert "CPU time per process" in ran.held


def test_removing_a_tree_deeper_than_a_path_can_name(tmp_path: Path) -> None:
    top = tmp_path / "tree"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(3000):  # 6,000+ characters of path: more than PATH_MAX
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.mkfifo("fifo", dir_fd=fd)
    os.symlink("/etc/passwd", "link", dir_fd=fd)
    os.close(fd)
    remove_tree(str(top))
    assert not top.exists() and Path("/etc/passwd").exists()


# ------------------------------------------------------------------------------ the host's files


@FULL
def test_the_trainers_files_are_not_there(host_files: dict[str, Path]) -> None:
    paths = {name: str(path) for name, path in host_files.items()}
    ran = run(
        f"""
        import os
        for path in {list(paths.values())!r} + [os.path.expanduser('~root/.bashrc'), '/etc/shadow']:
            try:
                print(open(path).read()[:20])
            except OSError as error:
                print(type(error).__name__)
        print(sorted(os.listdir('/work')) if os.path.exists('/work') else 'no /work')
        """
    )
    assert ran.ok, ran.stderr
    assert "hunter2" not in ran.stdout and '"a"' not in ran.stdout and "root:" not in ran.stdout


@FULL
@pytest.mark.parametrize(
    "change",
    [
        "os.chmod(path, 0o777)",
        "os.chmod(path, 0o4755)",  # the set-user-ID bit on a root-owned program
        "os.utime(path, (0, 0))",
        "os.setxattr(path, 'user.x', b'1')",
        "os.chown(path, 0, 0)",
        "open(path, 'a').write('x')",
        "os.rename(path, path + '.moved')",
        "open(os.path.join(os.path.dirname(path), 'planted'), 'w').write('x')",
    ],
)
def test_nothing_outside_its_directory_changes_not_even_metadata(change: str) -> None:
    path = os.path.realpath(sys.executable)
    before = os.stat(path)
    ran = run(f"import os\npath = {path!r}\n{change}\nprint('changed')")
    assert "changed" not in ran.stdout
    after = os.stat(path)
    assert (after.st_mode, after.st_mtime_ns, after.st_uid) == (
        before.st_mode,
        before.st_mtime_ns,
        before.st_uid,
    )
    assert not Path(os.path.dirname(path), "planted").exists()


# ------------------------------------------------------------------------------- IPC and network


@FULL
def test_the_hosts_shared_memory_sockets_and_dev_shm_are_out_of_reach(tmp_path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x50540000 + os.getpid() % 65536
    segment = libc.shmget(key, 4096, 0o1666)  # IPC_CREAT | 0666
    assert segment >= 0
    path_socket = socket.socket(socket.AF_UNIX)
    path_socket.bind(str(tmp_path / "s.sock"))
    path_socket.listen(1)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0posttrain-test-{os.getpid()}")
    abstract.listen(1)
    shm = Path("/dev/shm") / f"posttrain-test-{os.getpid()}"
    shm.write_text("secret")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        ran = run(
            f"""
            import ctypes, os, socket
            libc = ctypes.CDLL(None)
            print('shm', libc.shmget({key}, 4096, 0o666) >= 0, open('/proc/sysvipc/shm').read().count('\\n'))
            for address, family in (({str(tmp_path / "s.sock")!r}, socket.AF_UNIX),
                                    ('\\0posttrain-test-{os.getpid()}', socket.AF_UNIX),
                                    (('127.0.0.1', {port}), socket.AF_INET)):
                try:
                    socket.socket(family).connect(address)
                    print('connected')
                except OSError as error:
                    print('refused', error.errno)
            print('devshm', os.listdir('/dev/shm'))
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                udp.sendto(b'x', ('8.8.8.8', 53))
                print('sent')
            except OSError:
                print('unreachable')
            """
        )
    finally:
        libc.shmctl(segment, 0, None)  # IPC_RMID
        for s in (path_socket, abstract, server):
            s.close()
        shm.unlink()
    assert ran.ok, ran.stderr
    assert ran.stdout.splitlines()[0] == "shm False 1"  # the header line only
    assert "connected" not in ran.stdout and "sent" not in ran.stdout
    assert "devshm []" in ran.stdout


# ------------------------------------------------------------------------- processes and limits


@FULL
def test_it_cannot_signal_the_trainer_or_leave_its_confinement() -> None:
    ran = run(
        """
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        def attempt(name, call):
            try:
                result = call()
                print(name, 'ok' if result in (None, 0) else 'refused')
            except OSError:
                print(name, 'refused')
        attempt('kill-all', lambda: os.kill(-1, signal.SIGKILL))
        attempt('unshare-user', lambda: libc.unshare(0x10000000))
        attempt('mount', lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))
        attempt('hostname', lambda: libc.sethostname(b'x', 1))
        attempt('sysctl', lambda: open('/proc/sys/kernel/hostname', 'w').write('x'))
        attempt('setuid', lambda: os.setuid(0) if os.getuid() else libc.setuid(12345))
        print('alive')
        """
    )
    assert "alive" in ran.stdout
    for name in ("unshare-user", "mount", "hostname", "sysctl"):
        assert f"{name} refused" in ran.stdout, ran.stdout
    assert os.getpid() > 0  # this process is still here after the program's kill(-1)


@FULL
def test_limits_hold_for_the_whole_run_not_per_process() -> None:
    # six processes of 160 MiB each against a 256 MiB run: not all of them may hold their memory
    hogs = run(
        """
        import os, time
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                try:
                    block = bytearray(160 * 2**20)
                    for i in range(0, len(block), 4096):
                        block[i] = 1
                    time.sleep(3)
                    os._exit(0)
                except MemoryError:
                    os._exit(3)
            children.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        print('all held' if codes == [0] * 6 else f'stopped {codes}')
        """,
        Limits(wall=15, cpu=10, memory=256 * 2**20, processes=16, disk=32 * 2**20),
    )
    assert "all held" not in hogs.stdout, hogs
    disk = run(
        """
        import os
        written = 0
        try:
            with open('/tmp/fill', 'wb') as out:
                while True:
                    out.write(b'x' * 2**20)
                    out.flush()
                    written += 2**20
        except OSError:
            pass
        print(written)
        """
    )
    assert 0 < int(disk.stdout) <= LIMITS.disk, disk
    bomb = run(
        """
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError:
            print('stopped after', n)
        """
    )
    assert bomb.stdout.startswith("stopped after") and int(bomb.stdout.split()[-1]) < LIMITS.processes, bomb


@FULL
def test_time_memory_and_environment_limits() -> None:
    loop = run("while True:\n    pass\n", Limits(wall=3, cpu=1))
    assert not loop.ok and loop.seconds < 3.5
    hog = run("x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert "MemoryError" in hog.stderr and "allocated" not in hog.stdout
    os.environ["POSTTRAIN_TEST_SECRET"] = "hunter2"
    try:
        secret = run("import os\nprint(os.environ.get('POSTTRAIN_TEST_SECRET'), sorted(os.environ))")
    finally:
        del os.environ["POSTTRAIN_TEST_SECRET"]
    assert secret.stdout.startswith("None") and "hunter2" not in secret.stdout
    reads = run("import sys\nprint(repr(sys.stdin.read()))", stdin="given")
    assert reads.stdout.strip() == "'given'"


# ------------------------------------------------------------------------------ the code reward


SQUARE_TESTS = ["assert square(2) == 4", "assert square(3) == 9", "assert square(-1) == 1"]


@FULL
@pytest.mark.parametrize(
    ("code", "score"),
    [
        ("def square(x):\n    return x * x\n", 1.0),
        ("def square(x):\n    return x * 2\n", 1 / 3),
        # forgeries: an object equal to everything, an int subclass that says so, exec/eval replaced, the
        # old result line printed, the harness's own nonce found and a guess written under it, the harness's
        # encoder replaced, output closed, an early exit
        (
            "class E:\n    def __eq__(self, other):\n        return True\n\ndef square(x):\n    return E()\n",
            0.0,
        ),
        (
            "class I(int):\n    def __eq__(self, other):\n        return True\n\ndef square(x):\n    return I(0)\n",
            0.0,
        ),
        (
            "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: 9\n"
            "def square(x):\n    return 0\n",
            0.0,
        ),
        ("print('__posttrain_tests__ 3 3')\ndef square(x):\n    return 0\n", 0.0),
        (
            "import sys, json\nn = sys.modules['__main__']._nonce\nfor i in range(3):\n"
            "    sys.__stdout__.write(json.dumps([n, i, 0, 'value', ['int', 100]]) + '\\n')\n"
            "def square(x):\n    return 0\n",
            0.0,
        ),
        (
            "import sys\nsys.modules['__main__']._plain = lambda v, b=None: ['int', 100]\ndef square(x):\n    return 0\n",
            0.0,
        ),
        ("import os\nos.close(1)\ndef square(x):\n    return x * x\n", 0.0),
        ("import os\nos._exit(0)\n", 0.0),
    ],
)
def test_code_tests_are_compared_where_the_program_cannot_reach(code: str, score: float) -> None:
    assert code_tests.tests_passed(code, SQUARE_TESTS, LIMITS) == pytest.approx(score)


@FULL
def test_code_tests_take_setup_statements_and_other_assertions() -> None:
    code = "def add(a, b):\n    return a + b\n"
    tests = [
        "x = add(2, 3)\nassert x == 5",
        "assert add('a', 'b') in ['ab', 'ba']",
        "assert add(1, 1)",
        "assert add(1, 1) == 3",
        "for n in range(3):\n    assert add(n, 0) == n",
        "assert add(1, 2) == 3.0",  # Python's equality of plain values: 3 == 3.0
        "this is not python",
    ]
    assert code_tests.tests_passed(code, tests, LIMITS) == pytest.approx(5 / 7)


def test_the_command_runs_scores_and_checks(tmp_path: Path) -> None:
    program = tmp_path / "p.py"
    program.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n")
    command = [sys.executable, "-m", "posttrain", "sandbox"]
    done = subprocess.run(
        [*command, "run", str(program), "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "returncode": 3,
        "stdout": "out\n",
        "stderr": "err\n",
        "timed_out": False,
    }
    solution, tests = tmp_path / "s.py", tmp_path / "t.py"
    solution.write_text("def square(x):\n    return x * 2\n")
    tests.write_text("assert square(2) == 4\n\nassert square(3) == 9\n")
    done = subprocess.run(
        [*command, "score", str(solution), "--tests", str(tests), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and json.loads(done.stdout) == {"score": 0.5}, done.stderr
    done = subprocess.run([*command, "check"], capture_output=True, text=True, timeout=60)
    assert "namespaces:" in done.stdout and done.returncode == (1 if HOLDS.missing else 0)


def test_a_strict_sandbox_whose_cgroups_cannot_be_made_refuses_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The machine held cgroups at the start, this program's could not be made (the kernel refused one): a
    strict run does not go on without them silently; a run that accepts less does."""
    from posttrain.sandbox import confine as sandbox

    monkeypatch.setattr(sandbox, "run_cgroups", lambda limits: ([], [], set()))
    with pytest.raises(sandbox.SandboxError, match=r"cgroups .* could not be made for this program"):
        sandbox.run_python("print(1)", sandbox.Limits(wall=30), strict=True)
    assert sandbox.run_python("print(1)", sandbox.Limits(wall=30), strict=False).stdout.strip() == "1"


# ------------------------------------------------------------------------------ round three


@FULL
def test_the_trainers_keyrings_vsock_and_other_families_are_out_of_reach() -> None:
    """A keyring call (the trainer's session keyring shared through every login), io_uring (whose sockets
    would pass a socket rule) and every address family but Unix and IP fail; its session keyring is its own
    (seccomp and a fresh keyring, named by the check)."""
    key = subprocess.run(
        [sys.executable, "-c", "import ctypes; print(ctypes.CDLL(None).syscall(250, 0, -3, 0))"],
        capture_output=True,
        text=True,
    )  # the trainer's own session keyring, for comparison
    ran = run(
        """
        import ctypes, socket
        libc = ctypes.CDLL(None, use_errno=True)
        def errno(result):
            return ctypes.get_errno() if result < 0 else 0
        print(errno(libc.syscall(250, 0, -3, 0)), errno(libc.syscall(248, b"user", b"k", b"v", 1, -3)))
        print(errno(libc.syscall(425, 1, 0)))
        found = []
        for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, 40, socket.AF_NETLINK, socket.AF_PACKET):
            try:
                socket.socket(family, socket.SOCK_DGRAM).close()
                found.append(0)
            except OSError as error:
                found.append(error.errno)
        print(found)
        """
    )
    assert ran.ok, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "1 1" and lines[1] == "1", (lines, key.stdout)  # EPERM: keyctl, add_key; io_uring
    assert lines[2] == "[0, 0, 0, 97, 97, 97]"  # Unix, IPv4, IPv6 open; vsock, netlink, packet refused
    assert any("session keyring of its own" in line for line in HOLDS.held)
    assert any("seccomp" in line for line in HOLDS.held)


@FULL
def test_file_table_and_inotify_are_bounded_per_run() -> None:
    ran = run(
        """
        import os, resource, ctypes
        files = []
        try:
            while True:
                files.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as error:
            print(len(files), error.errno)
        libc = ctypes.CDLL(None, use_errno=True)
        made = 0
        while libc.inotify_init() >= 0 and made < 1000:
            made += 1
        print(made)
        """
    )
    assert ran.ok, ran.stderr
    opened, inotify = ran.stdout.splitlines()
    assert int(opened.split()[0]) < sandbox.FILES_OPEN and opened.split()[1] == "24"  # EMFILE
    assert int(inotify) <= 16


@FULL
@pytest.mark.skipif(os.getuid() != 0, reason="mounting a writable submount needs root")
def test_a_writable_mount_under_a_read_only_bind_is_read_only_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = tmp_path / "bound"
    (bound / "sub").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(bound / "sub")], check=True)
    try:
        binds = sandbox._binds
        monkeypatch.setattr(sandbox, "_binds", lambda: [*binds(), str(bound)])
        ran = run(
            f"""
            try:
                open("{bound}/sub/x", "w").write("x")
                print("wrote")
            except OSError as error:
                print(error.errno)
            """
        )
    finally:
        subprocess.run(["umount", str(bound / "sub")], check=True)
    assert ran.ok and ran.stdout.strip() == "30", ran  # EROFS


def test_a_sandbox_dies_with_whoever_started_it_on_sigkill(tmp_path: Path) -> None:
    """The reward worker, the trainer or the command is SIGKILLed while a program runs (SLURM, the OOM
    killer): the launcher, its child and the program's process 1 die with it, so the program does too."""
    starter = tmp_path / "starter.py"
    starter.write_text(
        textwrap.dedent(
            """
            import sys, time
            from posttrain.sandbox.confine import Limits, launched
            with launched("import time\\ntime.sleep(120)", Limits(wall=120, cpu=120), strict=False) as run:
                while run.pidfd is None and run.process.poll() is None:
                    time.sleep(0.01)
                print(run.process.pid, [n["pid"] for n in run.notes() if "pid" in n][0], flush=True)
                time.sleep(120)
            """
        )
    )
    process = subprocess.Popen([sys.executable, str(starter)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    launcher, program = map(int, process.stdout.readline().split())
    process.kill()
    process.wait()

    def running(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (running(launcher) or running(program)):
        time.sleep(0.05)
    assert not running(launcher) and not running(program)


@FULL
def test_stale_run_cgroups_are_swept_by_the_next_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed trainer's empty run cgroups are removed by the next process that makes one; one a live run
    uses (a process in it) is left. Swept in a parent of this test's own: every idle group counts as stale
    here, and a sweep of the machine's parent would take the groups other tests are making at the time."""
    groups, _, _ = sandbox.run_cgroups(LIMITS)  # real ones, where this machine makes them
    assert groups
    parent = Path(tempfile.mkdtemp(prefix="posttrain-sweep-", dir=groups[0].parent))
    stale = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=parent))
    other = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=parent))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (other / "cgroup.procs").write_text(str(sleeper.pid))
        monkeypatch.setattr(sandbox, "_SWEPT", set())
        monkeypatch.setattr(sandbox, "STALE_S", -1.0)
        sandbox._sweep(parent)
        assert not stale.exists() and other.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        for group in [other, stale, parent, *groups]:
            if group.exists():
                sandbox._remove_cgroup(group)


@FULL
def test_a_private_tmpdir_is_walked_around(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TMPDIR in a directory only its owner may enter (SLURM's per-job one, a home): the sandbox's root goes
    where the mapped user can walk (/tmp), and the program runs."""
    private = tmp_path / "private"
    (private / "tmp").mkdir(parents=True)
    private.chmod(0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private / "tmp"))
    assert sandbox.sandbox_tmp() != str(private / "tmp")
    ran = run("print('ran')")
    assert ran.ok and ran.stdout.strip() == "ran", ran
    monkeypatch.setattr(sandbox, "_walkable", lambda place: False)  # nowhere to walk to: one line
    with pytest.raises(UserError, match=r"no directory for the sandbox's root: .* set TMPDIR to one"):
        run("print('ran')")


@FULL
def test_output_printed_without_a_flush_is_kept_at_a_timeout() -> None:
    ran = run("import sys, time\nsys.stdout.write('unflushed')\ntime.sleep(30)\n", Limits(wall=1.5, cpu=10))
    assert ran.timed_out and ran.stdout == "unflushed"


def test_the_command_refuses_where_the_tool_would_and_escapes_terminal_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse
    import io

    from posttrain.commands import tools

    weaker = sandbox.Confinement(("CPU time per process",), (sandbox.REQUIRED["namespaces"],))
    monkeypatch.setattr(sandbox, "confinement", lambda: weaker)
    program = tmp_path / "p.py"
    program.write_text("print('\\x1b]0;owned\\x07\\x1b[2Jx')\n")
    args = argparse.Namespace(action="run", file=program, timeout=None, json=False, accept_weaker=False)
    with pytest.raises(UserError, match=r"lacks on this machine: namespaces.* --accept-weaker: true"):
        tools.cmd_sandbox(args)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown = tools._shown("\x1b]0;owned\x07\x1b[2Jx\n\tok", Terminal())
    assert shown == "\\x1b]0;owned\\x07\\x1b[2Jx\n\tok"
    assert tools._shown("\x1b[2J", io.StringIO()) == "\x1b[2J"  # a pipe gets the bytes


@FULL
@pytest.mark.skipif(
    os.getuid() != 0 or not Path("/usr/bin/unshare").exists(), reason="a PID namespace of its own needs root"
)
def test_no_zombie_is_left_to_a_trainer_that_is_process_1(tmp_path: Path) -> None:
    """A container's trainer is process 1: orphans come to it. Runs ended at their time limit leave it none."""
    script = tmp_path / "pid1.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            from pathlib import Path
            from posttrain.sandbox.confine import Limits, run_python
            assert os.getpid() == 1
            for _ in range(3):
                assert run_python("import time\\ntime.sleep(30)", Limits(wall=0.5, cpu=5)).timed_out
            time.sleep(0.5)
            states = []
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        states.append((entry / "stat").read_text().rsplit(")", 1)[1].split()[0])
                    except OSError:
                        pass
            print(states.count("Z"))
            """
        )
    )
    done = subprocess.run(
        ["/usr/bin/unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stdout + done.stderr
