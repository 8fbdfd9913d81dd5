"""A ``posttrain vllm-serve`` server beside the runs of a test, a demo or a benchmark: started for a config,
answering inside a ``with`` block, ended (with its engine process) after it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

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
    127.0.0.1 inside the block; its output in ``log_path``."""
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
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            text=True,
            start_new_session=True,
        )
        try:
            wait_for(f"http://127.0.0.1:{port}", server, 300)
            yield server
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)  # the server and its engine process
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
