"""A ``posttrain vllm-serve`` server beside the runs of a test, a demo or a benchmark: started for a config,
answering inside a ``with`` block, ended (with its engine process) after it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttrain.testing.env import child_env


def wait_for(url: str, server: subprocess.Popen, seconds: float) -> None:
    """Until ``url``'s ``/health`` answers; an error when the server exits or ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server at {url} exited ({server.returncode})")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"no server at {url} after {seconds:.0f} s")


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


#: looked up here, in the parent: the child between fork and exec imports nothing (another thread may have
#: held the import lock at the fork)
_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before it runs: SIGTERM when the process that started it dies, however it dies."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@contextlib.contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """Inside the block, SIGTERM (a ``timeout``, a scheduler's stop) exits this process the Python way, so
    the blocks around it run (the server they started is ended) instead of dying on the spot."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)

    def exit_now(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def server_process(
    command: list[str], log_path: Path, port: int, env: dict[str, str] | None = None, seconds: float = 300
) -> Iterator[subprocess.Popen]:
    """``command``, a server answering ``/health`` on ``port`` of 127.0.0.1, inside the block; its output in
    ``log_path``. It ends with the block, and with this process however that ends: SIGTERM and Ctrl-C end
    the block; a kill of this process sends the server SIGTERM (its parent-death signal)."""
    with open(log_path, "w") as log, _terminated_as_exit():
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            text=True,
            start_new_session=True,  # its own group: the server and its engine processes end together
            preexec_fn=die_with_parent,
        )
        try:
            wait_for(f"http://127.0.0.1:{port}", server, seconds)
            yield server
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)  # the server and its engine process
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


@contextlib.contextmanager
def vllm_server(
    config_path: Path,
    log_path: Path,
    port: int,
    cores: list[int] | None = None,
    overrides: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """``posttrain vllm-serve`` for a config (its threads on ``cores`` when given), up on ``port`` of
    127.0.0.1 inside the block (:func:`server_process`); its output in ``log_path``."""
    command = [
        sys.executable,
        "-m",
        "posttrain",
        "vllm-serve",
        str(config_path),
        *overrides,
        "--port",
        str(port),
    ]
    if cores:
        command += ["--cores", ",".join(map(str, cores))]
    with server_process(command, log_path, port, env) as server:
        yield server
