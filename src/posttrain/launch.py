"""Starting a run on several processes: the launcher command (torchrun or DeepSpeed's), the relay of
SIGTERM/SIGINT to the run's kill switch, and an exit status of 2 when any rank stopped on a user error."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from posttrain.training.stops import LAUNCH_NOTES

EXIT_USER_ERROR = 2


def launch_train(
    config: Path, overrides: list[str], nproc: int, launcher: str, launcher_args: str, kill_switch: str
) -> int:
    """Run ``posttrain train`` with ``nproc`` processes on this node through torchrun or DeepSpeed's
    launcher; ``launcher_args`` pass through (nodes, master address/port, hostfile, include/exclude)."""
    from posttrain.dist import free_port

    extra = shlex.split(launcher_args)
    port = (
        []
        if any(a.startswith(("--master_port", "--master-port", "--rdzv")) for a in extra)
        else [f"--master_port={free_port()}"]
    )
    # launcher module, its process-count flag, and how it is told to run a module
    launchers = {
        "deepspeed": ("deepspeed.launcher.runner", f"--num_gpus={nproc}", "--module"),
        "torchrun": ("torch.distributed.run", f"--nproc_per_node={nproc}", "-m"),
    }
    module, nproc_flag, module_flag = launchers[launcher]
    command = [sys.executable, "-m", module, nproc_flag, *port, *extra, module_flag, "posttrain"]
    command += ["train", str(config), *overrides]
    return _run_relaying_signals(command, kill_switch, nproc)


#: set by ``--nproc`` for the ranks: where a rank notes a user error (bad config or data) or a graceful stop
USER_ERROR_DIR = LAUNCH_NOTES


def note_user_error() -> None:
    """In a rank started by :func:`launch_train`: note that it stopped on a user error (exit status 2)."""
    directory = os.environ.get(USER_ERROR_DIR)
    if directory and "RANK" in os.environ:
        Path(directory, f"rank-{os.environ['RANK']}").write_text("user error\n")


def _user_errors(notes: Path) -> bool:
    return any(p.name.startswith("rank-") for p in notes.iterdir())


def _stopped(notes: Path) -> int:
    """How many of this node's ranks stopped gracefully after saving."""
    return sum(1 for p in notes.iterdir() if p.name.startswith("stopped-rank-"))


def _filter_launcher_errors(stream: Any, user_errors: Path) -> None:
    """Pass the launcher's standard error through, except, when a rank stopped on a user error (its message
    is already printed), the launcher's own ``ChildFailedError`` traceback and failure report."""
    held: list[str] = []
    dropping = False
    for line in stream:
        if dropping:
            continue
        if held or line.startswith("Traceback (most recent call last):"):
            held.append(line)
            if (
                line[:1].isspace()
                or line.startswith(("Traceback", "During handling", "The above"))
                or not line.strip()
            ):
                continue
            if ("ChildFailedError" in line and _user_errors(user_errors)) or "SignalException" in line:
                dropping = "SignalException" not in line  # a signalled launcher's own traceback: dropped
            else:
                sys.stderr.writelines(held)
            held = []
            continue
        if "failed (exitcode: 2)" in line and "torch/distributed/elastic" in line:
            continue  # the launcher's log line for a rank that exited on a user error
        if "torch/distributed/elastic" in line and ("death signal" in line or "closing signal" in line):
            continue  # the launcher passing SIGTERM on to the ranks, which stop after their step anyway
        sys.stderr.write(line)
    sys.stderr.writelines(held)
    sys.stderr.flush()


#: seconds torchrun waits for its ranks after a signal before it SIGKILLs them (its own default is 30 s, less
#: than a slow step and its stop-time checkpoint take): a stop saves first. SLURM's KillWait still bounds it.
#: A ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` the user set is kept. DeepSpeed's launcher has no such setting (30 s).
STOP_GRACE_S = 1800


def _run_relaying_signals(command: list[str], kill_switch: str, nproc: int) -> int:
    """Run the launcher in its own session and turn SIGTERM/SIGINT sent to this process into the run's kill
    switch: every rank then stops after the same step, saves, and exits 0. A second SIGINT kills the job.
    A rank that stops on a user error makes the whole command exit with status 2. The kill switch this
    relay wrote is removed when the job ends (the ranks remove it once the stop has saved; a job killed
    before that must not stop the next run at its first step)."""
    user_errors = Path(tempfile.mkdtemp(prefix="posttrain-errors-"))
    env = {**os.environ, USER_ERROR_DIR: str(user_errors)}
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_S))
    process = subprocess.Popen(command, start_new_session=True, env=env, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    forward = threading.Thread(
        target=_filter_launcher_errors, args=(process.stderr, user_errors), daemon=True
    )
    forward.start()
    received: list[str] = []

    def relay(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if received and signum == signal.SIGINT:
            os.killpg(process.pid, signal.SIGKILL)
            return
        received.append(name)
        Path(kill_switch).parent.mkdir(parents=True, exist_ok=True)
        Path(kill_switch).write_text(f"{name} received by the launcher\n")
        print(f"{name} received: every process stops after its current step ({kill_switch})", flush=True)

    previous = {sig: signal.signal(sig, relay) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = process.wait()
        forward.join()
        if code and _user_errors(user_errors):
            return EXIT_USER_ERROR
        if code and received and _stopped(user_errors) == nproc:
            return 0  # every rank stopped after saving; the launcher itself was signalled (SLURM)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(user_errors, ignore_errors=True)
        if received and os.path.exists(kill_switch):
            with contextlib.suppress(OSError):
                os.remove(kill_switch)
