"""A server a command or demo starts beside it (``testing.served.server_process``: the vLLM server of
``examples/grpo_demo.py``, the benchmarks, the tests) ends with it, however it ends: a SIGTERM (``timeout``,
a scheduler), Ctrl-C, or a SIGKILL of the process that started it. Real processes and a real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.dist import free_port

HEALTH = """
import http.server, os, sys
from pathlib import Path
Path(sys.argv[2]).write_text(str(os.getpid()))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

STARTER = """
import sys, time
from pathlib import Path
from posttrain.testing.served import server_process
port, root = int(sys.argv[1]), Path(sys.argv[2])
command = [sys.executable, str(root / "health.py"), str(port), str(root / "server.pid")]
with server_process(command, root / "server.log", port, seconds=60):
    print("up", flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has ended: its parent has not reaped it yet
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_server_ends_with_the_process_that_started_it(tmp_path: Path, how: signal.Signals) -> None:
    (tmp_path / "health.py").write_text(HEALTH)
    (tmp_path / "starter.py").write_text(STARTER)
    starter = subprocess.Popen(
        [sys.executable, str(tmp_path / "starter.py"), str(free_port()), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None and starter.stdout.readline().strip() == "up"
        server = int((tmp_path / "server.pid").read_text())
        assert _alive(server)
        starter.send_signal(how)
        starter.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server), f"the server outlived its starter ({how.name})"
    finally:
        starter.kill()


def test_ports_come_from_the_processs_range_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``POSTTRAIN_PORT_RANGE`` (each test worker its own) a port is handed out once, from the range,
    and never one something listens on."""
    import socket

    from posttrain import dist

    monkeypatch.setenv(dist.PORT_RANGE, "31000-31009")
    monkeypatch.setattr(dist, "_handed_out", set())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 31000 + (os.getpid() * 7919) % 10))  # the first the process would pick
        taken.listen()
        ports = [free_port() for _ in range(5)]
        assert taken.getsockname()[1] not in ports
    assert len(set(ports)) == 5 and all(31000 <= p <= 31009 for p in ports)
