"""The run's vLLM servers (``vllm_mode: server``): one, or a pool (``vllm_server_base_url`` as a list), each a
``posttrain vllm-serve`` on this or another machine. What the run needs of them is here: the HTTP client,
which servers may serve a batch, what happens when one is lost and when it comes back.

- Every server serves a batch only from the weights that batch must come from. Each push of the training
  weights has a tag (the run's nonce and the push's count) that the server's workers keep
  (``vllm_worker.PosttrainWorker.posttrain_tag``; a LoRA run's adapter is loaded under the tag as its name);
  before each call a process asks every server in the pool which tag it holds (one small request each: a
  server restarted in between holds the files' weights) and sends requests only to those holding the current
  one.
- Each process spreads its completions over those servers (request i to server i mod n). A completion is drawn
  from its own key (the request's seed), so it does not depend on the server that draws it: a pool gives the
  numbers of one server.
- A lost server (the connection refused or reset, a request past ``request_timeout``, an HTTP 5xx): its
  requests go to the others and the run goes on, said in one line. Every few seconds, and at every push, the
  run looks at it again: when it answers (restarted at its address), rank 0 gives it the current weights
  (kept in the weights folder until the next push; a LoRA run's adapter loaded again unless the server still
  holds it) and it serves again. Every server lost: the run waits ``vllm_server_timeout`` for one to come
  back, then stops naming them and the command that starts one.
- A process asked to stop (``stopping``: a signal came) waits for no server that the stop took with it: not
  for a lost server to come back, nor for the answer of one that no longer answers ``/health`` (a vLLM server
  shutting down holds its requests unanswered until their connections close). Its generation gives up
  (``GenerationStopped``) and the run saves after its last whole step.
- Nothing retries without a bound. A server whose requests fail :data:`STRIKES` times in a row (each failure
  at most ``request_timeout``; a success in between starts the count again) is out for the rest of the run,
  though it answers ``/health``: one line names it and what it answered. A request is sent at most
  :data:`TRIES` times; past that the run stops naming it and each server's last failure. With every server
  out for good, the run stops at once.
- A weight push that stalls (no answer within ``weight_sync_timeout``) stops the run naming the server and the
  push, never a silent hang; a server that dies during a push is lost like any other.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import io
import json
import select
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from posttrain.errors import UserError
from posttrain.generation.types import GenerationStopped
from posttrain.generation.vllm_engine import check_reload
from posttrain.logs import get_logger

#: seconds between two looks at a lost server while the others generate
LOOK_AGAIN = 5.0
#: failed requests in a row after which a server is out for the rest of the run
STRIKES = 3
#: times one request is sent (to one server, then the others) before the run stops
TRIES = 4
#: requests a process keeps in flight per server (one thread each), and at most in all
IN_FLIGHT_PER_SERVER, MAX_IN_FLIGHT = 64, 512
#: tries of ``/reset_prefix_cache`` (it answers ``success: false`` while blocks are still held)
RESET_TRIES = 10
#: how a request failed, for :attr:`ServerError.kind`
REFUSED, RESET, TIMEOUT, SERVER_FAILED, ANSWERED_NO, OTHER = (
    "refused",
    "reset",
    "timeout",
    "5xx",
    "4xx",
    "other",
)
#: failures after which a server is out of the pool (its requests go to the others)
LOST_KINDS = {REFUSED, RESET, TIMEOUT, SERVER_FAILED}
START_COMMAND = "posttrain vllm-serve CONFIG --port PORT"


class Closing(OSError):
    """A server that stopped answering ``/health`` while it held a request of a process asked to stop."""


def failure(error: BaseException) -> tuple[str, str]:
    """A failed request, as (kind, words): refused, reset, timed out, an HTTP status, or what it said."""
    if isinstance(error, Closing):
        return RESET, "stopped answering while the run stops (it is shutting down)"
    if isinstance(error, urllib.error.HTTPError):
        body = ""
        with contextlib.suppress(Exception):
            body = " ".join(error.read().decode(errors="replace").split())[:300]  # one line
        kind = SERVER_FAILED if error.code >= 500 else ANSWERED_NO
        return kind, f"answered HTTP {error.code} {error.reason}" + (f" ({body})" if body else "")
    reason = getattr(error, "reason", error)  # URLError wraps the socket's error
    if isinstance(reason, ConnectionRefusedError):
        return REFUSED, "refused the connection (nothing listens there)"
    if isinstance(reason, ConnectionResetError | BrokenPipeError) or isinstance(
        error, http.client.RemoteDisconnected
    ):
        return RESET, "closed the connection before answering (it died or was restarted)"
    if isinstance(
        error, http.client.HTTPException
    ):  # an answer cut short (IncompleteRead), a broken status line
        return RESET, f"broke off its answer ({type(error).__name__}: it died or was restarted)"
    if isinstance(reason, TimeoutError):  # socket.timeout too
        return TIMEOUT, "did not answer in time"
    if isinstance(error, ValueError):
        return OTHER, f"answered something that is not JSON ({error})"
    return OTHER, f"failed: {reason}"


class ServerError(UserError):
    """A request to a vLLM server that failed: which server, what the run asked, what happened."""

    def __init__(self, url: str, doing: str, why: str, fix: str = "", kind: str = OTHER) -> None:
        self.url, self.doing, self.why, self.kind = url, doing, why, kind
        advice = fix or "check the server's log; restart it with posttrain vllm-serve CONFIG"
        super().__init__(f"vllm_mode: server: the vLLM server at {url} {why} while {doing}; {advice}")

    @property
    def lost(self) -> bool:
        """Whether the server is gone or broken (rather than refusing what was asked)."""
        return self.kind in LOST_KINDS


class ServerClient:
    """JSON over HTTP to one server (the standard library's client: no dependency for a handful of calls);
    every failure is a :class:`ServerError` naming the server and what the run was asking of it."""

    def __init__(
        self,
        url: str,
        timeout: float,
        request_timeout: float = 600.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.url, self.timeout, self.request_timeout = url, timeout, request_timeout
        self.stopping = stopping  # the process was asked to stop (see :meth:`_watched`)

    def call(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        timeout: float | None = None,
        doing: str = "",
        fix: str = "",
        text_answer: bool = False,
    ) -> Any:
        """The JSON answer (``text_answer``: the answer as text, for vLLM's endpoints that answer in words).
        A request with a body waits for its answer watching the server (see :meth:`_watched`)."""
        try:
            if body is not None:
                text = self._watched(
                    path, json.dumps(body).encode(), timeout or self.request_timeout
                ).decode()
            else:
                with urllib.request.urlopen(
                    self.url + path, timeout=timeout or self.request_timeout
                ) as response:
                    text = response.read().decode()
            if text_answer:
                return text
            return json.loads(text) if text.strip() else None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as error:
            kind, why = failure(error)
            raise ServerError(self.url, doing or f"POST {path}", why, fix, kind) from None

    def _watched(self, path: str, data: bytes, timeout: float) -> bytes:
        """POST ``data`` and wait for the answer (``timeout`` seconds at most) a second at a time: once this
        process is asked to stop, a server that no longer answers ``/health`` (shutting down with the
        allocation: it holds the request without answering until its connections close) is not waited for
        (:class:`Closing`: it is lost); one that answers is."""
        parts = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
        try:
            connection.request(
                "POST", parts.path.rstrip("/") + path, body=data, headers={"Content-Type": "application/json"}
            )
            deadline, looked = time.monotonic() + timeout, 0.0
            while not select.select([connection.sock], [], [], 1.0)[0]:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError("timed out")
                if self.stopping() and now - looked > 2.0:
                    looked = now
                    if not self.answers(2.0):
                        raise Closing()
            response = connection.getresponse()
            answer = response.read()
            if response.status >= 400:
                raise urllib.error.HTTPError(
                    self.url + path, response.status, response.reason, response.headers, io.BytesIO(answer)
                )
            return answer
        finally:
            connection.close()

    def answers(self, seconds: float = 2.0) -> bool:
        """Whether ``/health`` answers within ``seconds``."""
        try:
            self.call("/health", timeout=seconds)
            return True
        except ServerError:
            return False

    def reset_prefix_cache(self, doing: str) -> None:
        """The server's prefix cache emptied (a push's last step: otherwise prompts longer than a KV block keep
        the old weights' keys and values); vLLM answers ``success: false`` while blocks are still held, so it
        is asked again for a few seconds, then the run stops naming the server."""
        for attempt in range(RESET_TRIES):
            answer = self.call("/reset_prefix_cache", {}, doing=doing)
            if not isinstance(answer, dict) or answer.get("success", True) is not False:
                return
            time.sleep(0.05 * 2 ** min(attempt, 5))
        raise ServerError(
            self.url,
            doing,
            f"could not empty its prefix cache ({RESET_TRIES} tries answered success: false: blocks still held)",
            "check that nothing else sends it requests while the run pushes weights",
        )

    def rpc(self, method: str, timeout: float | None = None, doing: str = "", **kwargs: Any) -> list[Any]:
        """One of posttrain's worker methods (``vllm_worker.PosttrainWorker``) on every worker: their results."""
        fix = (
            "it must be a server posttrain vllm-serve started (its weight-update endpoints on); check its log"
        )
        answer = self.call(
            "/collective_rpc", {"method": method, "kwargs": kwargs}, timeout=timeout, doing=doing, fix=fix
        )
        return list((answer or {}).get("results", []))


class ServerKind(Protocol):
    """What a pool asks of one kind of server, beyond ``/health`` (:meth:`ServerClient.answers`): the pool's
    logic (who serves, a lost server's requests sent to the others, one that comes back given the current
    weights) is the same for every kind. :class:`VLLMServers` is ``posttrain vllm-serve``'s; a test drives
    the pool with a kind of its own (``tests/unit/test_server_pool.py``)."""

    #: how the run's lines name one of its servers ("vLLM server")
    name: str

    def holds(self, client: ServerClient, tag: str | None) -> str | None:
        """The tag of the weights the server holds (None: others, or it cannot say); ``tag``: the current."""
        ...

    def reload(
        self, client: ServerClient, folder: Path, tag: str, previous: str | None, timeout: float, pushing: str
    ) -> None:
        """The server takes the weights in ``folder`` under ``tag`` (``previous``: the push before) within
        ``timeout`` seconds; a :class:`ServerError` when it does not."""
        ...

    def complete(self, client: ServerClient, body: dict[str, Any], doing: str) -> dict[str, Any]:
        """One completion request's answer."""
        ...


class VLLMServers:
    """``posttrain vllm-serve``'s servers: weights reloaded by posttrain's worker extension (or, for a LoRA
    run, the adapter loaded by vLLM's LoRA endpoints), tags kept by the workers, ``/v1/completions``."""

    name = "vLLM server"

    def __init__(self, adapter: bool = False) -> None:
        self.adapter = adapter  # a LoRA run's pushes are adapters, loaded by vLLM's LoRA endpoints

    def holds(self, client: ServerClient, tag: str | None) -> str | None:
        doing = "saying which weights it holds"
        if self.adapter:
            served = client.call("/v1/models", timeout=30.0, doing=doing)
            names = {str(entry.get("id")) for entry in (served or {}).get("data") or []}
            return tag if tag in names else None
        tags = set(client.rpc("posttrain_tag", timeout=30.0, doing=doing))
        return tags.pop() if len(tags) == 1 else None

    def reload(
        self, client: ServerClient, folder: Path, tag: str, previous: str | None, timeout: float, pushing: str
    ) -> None:
        if not self.adapter:
            results = client.rpc(
                "posttrain_reload", timeout=timeout, doing=pushing, weights_path=str(folder), tag=tag
            )
            check_reload(results, f"the vLLM server at {client.url}")
            client.reset_prefix_cache(pushing)
            return
        # the current adapter loaded under its tag, the previous one dropped. A server that holds it already
        # (one that comes back after a passing failure) is not sent it again: vLLM refuses a name it has loaded
        fix = (
            "start the server with posttrain vllm-serve for this config (vLLM's LoRA and runtime loading on)"
        )
        if self.holds(client, tag) != tag:
            body = {"lora_name": tag, "lora_path": str(folder)}
            client.call("/v1/load_lora_adapter", body, timeout, pushing, fix, text_answer=True)
        if previous:
            with contextlib.suppress(ServerError):  # a server that was restarted does not have it
                client.call(
                    "/v1/unload_lora_adapter", {"lora_name": previous}, 30.0, pushing, text_answer=True
                )

    def complete(self, client: ServerClient, body: dict[str, Any], doing: str) -> dict[str, Any]:
        answer: dict[str, Any] = client.call("/v1/completions", body, doing=doing)
        return answer


@dataclass
class Server:
    """One server of the pool as this process sees it: the weights it was seen to hold, why it is out."""

    client: ServerClient
    holds: str | None = None
    lost: str = ""  # why it is out of the pool ("" while in)
    looked: float = 0.0  # when the run last looked whether a lost server is back
    strikes: int = 0  # its requests that failed in a row
    out: bool = False  # out for the rest of the run (STRIKES failures in a row)


class ServerPool:
    """The run's servers (see the module docstring). Rank 0 pushes (:meth:`reload_all`) and rejoins servers;
    every process confirms which servers hold a push (:meth:`confirm`) and spreads its requests
    (:meth:`complete`)."""

    def __init__(
        self,
        urls: Sequence[str],
        timeout: float,
        request_timeout: float,
        sync_timeout: float,
        main: bool,
        adapter: bool = False,
        stopping: Callable[[], bool] = lambda: False,
        kind: ServerKind | None = None,
    ) -> None:
        """``kind``: what the servers are (default ``posttrain vllm-serve``'s: :class:`VLLMServers`, serving a
        LoRA run's adapter with ``adapter``)."""
        self.kind: ServerKind = kind or VLLMServers(adapter)
        self.servers = [Server(ServerClient(url, timeout, request_timeout, stopping)) for url in urls]
        self.stopping = stopping  # this process was asked to stop: no wait for a lost server to come back
        self.timeout, self.sync_timeout, self.main = timeout, sync_timeout, main
        self.tag: str | None = None  # the current push's tag (an adapter's: its name on the servers)
        self.previous: str | None = None
        self.tagged = True  # the servers keep the pushes' tags (not with weights sent over NCCL)
        self.folder: Path | None = None  # rank 0: the current weights (kept for a server that comes back)
        self.lock = threading.RLock()
        workers = min(MAX_IN_FLIGHT, IN_FLIGHT_PER_SERVER * len(self.servers))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="posttrain-server")
        self.lost_events = self.rejoined_events = 0
        atexit.register(
            self.close
        )  # the weights folder goes with the process, whatever stops it (not SIGKILL)
        self.gave_up: UserError | None = None
        self.closed = False

    @property
    def urls(self) -> list[str]:
        return [server.client.url for server in self.servers]

    # ------------------------------------------------------------------------------------------ start

    def start(self, check: Callable[[ServerClient], str]) -> str:
        """Rank 0: wait up to ``vllm_server_timeout`` for every server, check each that answers
        (``check``: the served model's name); go on without those that did not answer (they may join later),
        or stop when none did."""
        deadline = time.monotonic() + self.timeout
        waiting = list(self.servers)
        names: list[str] = []
        while waiting:
            for server in list(waiting):
                if server.client.answers(5.0):
                    names.append(check(server.client))
                    waiting.remove(server)
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if len(waiting) == len(self.servers):
            raise UserError(
                f"vllm_mode: server: no vLLM server answered at {', '.join(self.urls)} within {self.timeout:g} s "
                f"(vllm_server_timeout); start it with `posttrain vllm-serve CONFIG` (same config), or set "
                "vllm_server_base_url / vllm_server_host / vllm_server_port to where it runs"
            )
        for server in waiting:
            server.lost = "did not answer at the start"
            get_logger().warning(
                f"{self.kind.name} at {server.client.url} did not answer within {self.timeout:g} s: the run starts "
                f"without it and gives it the weights when it answers ({START_COMMAND})"
            )
        return names[0]

    # ---------------------------------------------------------------------------------------- weights

    def drop_weights(self) -> None:
        """Rank 0, before it writes the next weights: the current ones' folder removed (a server that comes
        back from now on is given the next ones), so the machine holds one copy of the weights, not two."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def reload_all(self, folder: Path, tag: str, pushing: str) -> None:
        """Rank 0: every server reloads the weights in ``folder`` (kept until the next push, for a server
        that comes back); a lost one that answers again takes them too. Waits for one when none took them."""
        self.drop_weights()
        self.folder, self.previous, self.tag = folder, self.tag, tag
        list(self.pool.map(lambda server: self._reload(server, pushing), self.servers))
        if not self._serving() and not self.stopping():  # stopping: the generation that follows gives up
            self._wait_for_one()

    def _reload(self, server: Server, pushing: str) -> None:
        if server.out or (server.lost and not server.client.answers()):
            return
        assert self.folder is not None
        try:
            self.kind.reload(
                server.client, self.folder, self.tag or "", self.previous, self.sync_timeout, pushing
            )
        except ServerError as error:
            if error.kind not in (REFUSED, RESET):  # a stall or a failed reload is the run's error
                raise
            self._lose(server, error)
            return
        self._back(server)

    def confirm(self, tag: str, ask: bool = True) -> None:
        """Every process after a push: which servers hold ``tag`` (``ask`` false: all that are in, for
        weights sent another way than a reload)."""
        self.tag, self.tagged = tag, ask
        if not ask:
            for server in self.servers:
                if not server.lost:
                    server.holds = tag
        elif not self.main:
            list(self.pool.map(self._ask, self.servers))

    def _ask(self, server: Server) -> None:
        if server.out:  # out for the rest of the run, whatever it holds
            return
        try:
            server.holds = self.kind.holds(server.client, self.tag)
        except ServerError as error:
            if not error.lost:
                raise
            self._lose(server, error)
            return
        if server.holds == self.tag:
            self._back(server)
        elif not server.lost:  # rank 0 could not give it the weights: looked at again as a lost one
            server.lost, server.looked = "does not hold the current weights", time.monotonic()

    # ------------------------------------------------------------------------------------- generation

    def complete(self, bodies: Sequence[dict[str, Any]], doing: str) -> list[dict[str, Any]]:
        """Every body to ``/v1/completions``, spread over the servers holding the current weights; a lost
        server's requests sent again to the others."""
        self.gave_up = None
        if (
            self.tagged
        ):  # a server restarted since it was last seen holds the files' weights: out until given ours
            list(self.pool.map(self._ask, [server for server in self.servers if not server.lost]))
        serving = self._serving(look=True) or self._wait_for_one()
        jobs = [(body, serving[i % len(serving)]) for i, body in enumerate(bodies)]
        return list(self.pool.map(lambda job: self._complete(job[0], job[1], doing), jobs))

    def _complete(self, body: dict[str, Any], server: Server, doing: str) -> dict[str, Any]:
        failures: list[str] = []
        for _ in range(TRIES):
            try:
                answer = self.kind.complete(server.client, body, doing)
            except ServerError as error:
                if not error.lost:
                    raise
                failures.append(f"{server.client.url} {error.why}")
                self._lose(server, error, strike=True)
                server = self._another(server)
                continue
            server.strikes = 0
            return answer
        raise UserError(
            f"vllm_mode: server: a request failed {TRIES} times while {doing} ({'; '.join(failures)}); check the "
            f"servers' logs (each failure took at most request_timeout {server.client.request_timeout:g} s), "
            "then resume the run"
        )

    def _another(self, after: Server) -> Server:
        """The next server holding the current weights after ``after`` (waiting for one when none)."""
        with self.lock:
            serving = self._serving() or self._wait_for_one()
            order = self.servers.index(after)
            return min(serving, key=lambda s: (self.servers.index(s) - order - 1) % len(self.servers))

    def _serving(self, look: bool = False) -> list[Server]:
        """The servers in the pool that hold the current weights (``look``: first look again at lost ones
        not looked at for :data:`LOOK_AGAIN` seconds)."""
        if look:
            now = time.monotonic()
            for server in self.servers:
                if server.lost and not server.out and now - server.looked > LOOK_AGAIN:
                    self._look(server)
        return [s for s in self.servers if not s.lost and s.holds == self.tag]

    def _look(self, server: Server) -> None:
        """Whether a lost server is back: rank 0 gives it the current weights, the others ask what it holds."""
        server.looked = time.monotonic()
        if not server.client.answers():
            return
        if not self.main:
            self._ask(server)
        elif self.folder is not None:
            self._reload(
                server,
                f"taking the current weights as it rejoins (weight_sync_timeout {self.sync_timeout:g} s)",
            )

    def _wait_for_one(self) -> list[Server]:
        """Every server is lost: look at them every second for ``vllm_server_timeout``, then stop (the
        other requests of the call stop with the same error, without a wait of their own)."""
        if self.gave_up is not None:
            raise self.gave_up
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not self.closed:
            if self.stopping():
                raise GenerationStopped(
                    "the run is stopping and every vLLM server is lost: "
                    + "; ".join(f"{s.client.url} {s.lost}" for s in self.servers)
                )
            if all(server.out for server in self.servers):
                why = "; ".join(f"{s.client.url} {s.lost}" for s in self.servers)
                self.gave_up = UserError(
                    f"vllm_mode: server: every vLLM server of the run is out ({why}); check their logs, restart "
                    f"them with `{START_COMMAND}`, then resume the run"
                )
                raise self.gave_up
            for server in self.servers:
                if server.lost and not server.out:
                    self._look(server)
            serving = self._serving()
            if serving:
                return serving
            time.sleep(1.0)
        why = "; ".join(f"{s.client.url} {s.lost or 'holds other weights'}" for s in self.servers)
        self.gave_up = UserError(
            f"vllm_mode: server: every vLLM server of the run is lost ({why}) and none came back within "
            f"{self.timeout:g} s (vllm_server_timeout); start them again with `{START_COMMAND}` on their "
            "machines (the run gives a server the current weights when it answers), then resume the run"
        )
        raise self.gave_up

    def _lose(self, server: Server, error: ServerError, strike: bool = False) -> None:
        """``server`` out of the pool for now (``strike``: a failed request, counted towards
        :data:`STRIKES`, after which it is out for the rest of the run)."""
        with self.lock:
            if (
                strike and not server.lost
            ):  # one strike for each time it leaves the pool, however many requests
                server.strikes += 1
            if server.strikes >= STRIKES and not server.out:
                server.out = True
                server.lost, server.holds = (
                    f"failed {server.strikes} requests in a row (last: {error.why})",
                    None,
                )
                self.lost_events += 1
                others = len([s for s in self.servers if not s.lost])
                get_logger().warning(
                    f"{self.kind.name} at {server.client.url} {server.lost}: out of the pool for the rest of the run, "
                    f"its requests go to the {others} other(s); restart it and resume the run to use it again"
                )
                return
            if server.lost:
                return
            server.lost, server.holds, server.looked = error.why, None, time.monotonic()
            self.lost_events += 1
            others = len([s for s in self.servers if not s.lost])
        get_logger().warning(
            f"{self.kind.name} at {server.client.url} {error.why} while {error.doing}: out of the pool, its requests "
            f"go to the {others} other(s); it rejoins when it answers again"
        )

    def _back(self, server: Server) -> None:
        with self.lock:
            was, server.lost, server.holds = server.lost, "", self.tag
            if not was:
                return
            self.rejoined_events += 1
        get_logger().warning(
            f"{self.kind.name} at {server.client.url} is back with the current weights: it serves again"
        )

    def close(self) -> None:
        self.closed = True  # a wait for a server to come back ends (the run is over)
        self.pool.shutdown(wait=False)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
