"""A pool of vLLM servers (``server_pool.ServerPool``) against servers on 127.0.0.1 that speak the endpoints the
run uses (``/health``, ``/collective_rpc`` with posttrain's worker methods, ``/v1/completions``): real sockets,
real threads, servers killed and started again at their port. A fake server's completion is a function of the
request's seed and of the weights it holds, so an answer from the wrong weights shows. The same pool against
vLLM's CPU build: ``tests/integration/test_server_pool_vllm.py``."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from posttrain.errors import UserError
from posttrain.generation import server_pool
from posttrain.generation.server_pool import ServerPool


class _Quiet(http.server.ThreadingHTTPServer):
    """A client that gave up on an answer (a stalled push) is not a traceback in the test's output."""

    allow_reuse_address = True
    request_queue_size = (
        128  # the pool's 64 request threads a server at once (a real server's backlog is larger)
    )

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class _JsonHandler(http.server.BaseHTTPRequestHandler):
    """A quiet handler that answers JSON."""

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, answer: Any) -> None:
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeServer:
    """Answers like ``posttrain vllm-serve``: its weights are the tag of the last reload; ``stall`` seconds
    spent in every reload; :meth:`stop` closes its port, :meth:`start` opens it again (weights gone)."""

    def __init__(self, port: int = 0, stall: float = 0.0, die_after: int | None = None) -> None:
        self.port, self.stall, self.die_after = port, stall, die_after
        self.broken: int | str = 0  # a status to answer every completion with (500), or "hang"
        self.fail_next = 0  # completions to answer 500 before serving again (a passing failure)
        self.unreset = 0  # /reset_prefix_cache calls to answer success: false (blocks still held)
        self.tag: str | None = None
        self.served = 0
        self.reloads: list[str] = []
        self.held = threading.Event()
        self.start()

    def start(self) -> None:
        outer = self

        class Handler(_JsonHandler):
            def do_GET(self) -> None:
                names = ["m", *sorted(outer.adapters)]
                self._json({"data": [{"id": name, "root": "m", "max_model_len": 4096} for name in names]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/collective_rpc" and body["method"] == "posttrain_reload":
                    time.sleep(outer.stall)
                    outer.tag = body["kwargs"]["tag"]
                    outer.reloads.append(outer.tag or "")
                    return self._json({"results": [{"refreshed": [], "missing": []}]})
                if self.path == "/collective_rpc":
                    return self._json({"results": [outer.tag]})
                if self.path == "/v1/load_lora_adapter" and body["lora_name"] in outer.adapters:
                    return self.send_error(
                        400, f"The lora adapter '{body['lora_name']}' has already been loaded"
                    )
                if self.path == "/reset_prefix_cache":
                    outer.unreset -= 1
                    return self._json({"success": outer.unreset < 0})
                if self.path == "/v1/load_lora_adapter":
                    outer.adapters.add(body["lora_name"])
                    outer.reloads.append(body["lora_name"])
                    return self._json("Success: LoRA adapter loaded")
                if self.path == "/v1/unload_lora_adapter":
                    outer.adapters.discard(body["lora_name"])
                    return self._json("Success: LoRA adapter unloaded")
                if self.path == "/v1/completions" and body["model"] not in {"m", *outer.adapters}:
                    return self.send_error(404, f"model {body['model']} not found")
                if self.path == "/v1/completions" and outer.broken == "hold":
                    outer.held.wait(30)  # a server shutting down: the request held, never answered
                    return self.send_error(503)
                if self.path == "/v1/completions" and outer.broken == "hang":
                    time.sleep(2.0)  # past the client's request_timeout
                    return self.send_error(504)
                if self.path == "/v1/completions" and (outer.broken or outer.fail_next > 0):
                    outer.fail_next -= 1
                    outer.failed += 1
                    return self.send_error(500, "Internal Server Error")
                if self.path == "/v1/completions":
                    outer.served += 1
                    if outer.die_after is not None and outer.served > outer.die_after:
                        self.connection.shutdown(2)  # killed while generating
                        threading.Thread(target=outer.stop).start()
                        return
                    weights = zlib.crc32((outer.tag or "files").encode()) % 1000
                    return self._json({"choices": [{"token_ids": [body["seed"] % 1000, weights]}]})
                self._json({})

        self.server = _Quiet(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag, self.die_after = None, None if self.served else self.die_after
        self.adapters: set[str] = set()
        self.failed = getattr(self, "failed", 0)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Any:
    started: list[FakeServer] = []

    def make(count: int, **kw: Any) -> list[FakeServer]:
        started.extend(FakeServer(**kw) for _ in range(count))
        return started[-count:]

    yield make
    for server in started:
        with contextlib.suppress(OSError):
            server.stop()


def pool_of(
    urls: list[str], main: bool = True, timeout: float = 3.0, sync: float = 10.0, request: float = 5.0
) -> ServerPool:
    return ServerPool(urls, timeout, request_timeout=request, sync_timeout=sync, main=main)


def push(pool: ServerPool, tmp_path: Path, tag: str) -> None:
    folder = tmp_path / f"{id(pool)}-{tag}"
    folder.mkdir(parents=True)
    pool.reload_all(folder, tag, "taking the new weights (weight_sync_timeout 10 s)")
    pool.confirm(tag)


BODIES = [{"seed": 1000 + i, "prompt": [1, 2], "model": "m"} for i in range(24)]


def tokens(answers: list[dict[str, Any]]) -> list[list[int]]:
    return [answer["choices"][0]["token_ids"] for answer in answers]


def test_a_pool_gives_one_servers_answers_and_spreads_the_work(servers: Any, tmp_path: Path) -> None:
    one, *three = servers(4)
    alone = pool_of([one.url])
    assert alone.start(lambda client: "m") == "m"
    push(alone, tmp_path, "run-1")
    expected = tokens(alone.complete(BODIES, "generating"))
    pool = pool_of([s.url for s in three])
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    assert tokens(pool.complete(BODIES, "generating")) == expected
    assert [s.served for s in three] == [8, 8, 8] and all(s.reloads == ["run-1"] for s in three)
    alone.close(), pool.close()


def test_a_server_killed_while_generating_costs_no_answer_and_rejoins_when_back(
    servers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reference, steady = servers(2)
    dying = servers(1, die_after=3)[0]
    alone = pool_of([reference.url])
    alone.start(lambda client: "m")
    push(alone, tmp_path, "run-1")
    expected = tokens(alone.complete(BODIES, "generating"))

    pool = pool_of([steady.url, dying.url])
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    with caplog.at_level("WARNING", logger="posttrain"):
        assert tokens(pool.complete(BODIES, "generating")) == expected  # the lost server's requests resent
    assert (
        f"vLLM server at {dying.url} closed the connection" in caplog.text
        and "out of the pool" in caplog.text
    )
    assert steady.served == len(BODIES) - 3 and pool.lost_events == 1

    push(pool, tmp_path, "run-2")  # pushed while it is away: the others take the weights
    assert dying.reloads == ["run-1"]
    dying.start()  # back at its address, with the files' weights
    monkeypatch.setattr(server_pool, "LOOK_AGAIN", 0.0)
    before = dying.served
    with caplog.at_level("WARNING", logger="posttrain"):
        again = tokens(pool.complete(BODIES, "generating"))
    assert (
        dying.reloads == ["run-1", "run-2"] and dying.served > before
    )  # given the current weights, it serves
    assert f"vLLM server at {dying.url} is back with the current weights" in caplog.text
    assert len({pair[1] for pair in again}) == 1  # every answer from the same weights
    pool.close(), alone.close()


def test_another_rank_uses_only_servers_that_hold_the_current_weights(servers: Any, tmp_path: Path) -> None:
    """Rank 1 asks each server which weights it holds after a push: one rank 0 could not reach is left out
    until rank 0 gives it the weights, then rank 1 sees it back."""
    good, behind = servers(2)
    main = pool_of([good.url])
    main.start(lambda client: "m")
    push(main, tmp_path, "run-1")  # only `good` takes run-1
    other = pool_of([good.url, behind.url], main=False)
    other.confirm("run-1")
    assert [s.holds for s in other.servers] == ["run-1", None] and other.servers[1].lost
    other.complete(BODIES, "generating")
    assert behind.served == 0
    behind.tag = "run-1"  # rank 0 gives it the weights
    other.servers[1].looked = 0.0
    server_pool.LOOK_AGAIN, kept = 0.0, server_pool.LOOK_AGAIN
    try:
        other.complete(BODIES, "generating")
    finally:
        server_pool.LOOK_AGAIN = kept
    assert behind.served == len(BODIES) // 2
    main.close(), other.close()


def test_a_stalled_push_and_every_server_lost_are_each_one_line(servers: Any, tmp_path: Path) -> None:
    (stalled,) = servers(1, stall=3.0)
    pool = pool_of([stalled.url], sync=0.5)
    pool.start(lambda client: "m")
    with pytest.raises(UserError) as caught:
        push(pool, tmp_path, "run-1")
    assert f"the vLLM server at {stalled.url} did not answer in time while taking the new weights" in str(
        caught.value
    )
    a, b = servers(2)
    pool = pool_of([a.url, b.url], timeout=1.5)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    a.stop(), b.stop()
    started = time.monotonic()
    with pytest.raises(UserError) as caught:
        pool.complete(BODIES, "generating")
    line = str(caught.value)
    assert time.monotonic() - started < 10
    assert f"every vLLM server of the run is lost ({a.url} refused the connection" in line
    assert b.url in line and "within 1.5 s (vllm_server_timeout)" in line and "posttrain vllm-serve" in line


def test_a_process_asked_to_stop_does_not_wait_for_lost_servers(servers: Any, tmp_path: Path) -> None:
    """Every server lost while the process is stopping (its allocation ended: the servers went with it): the
    call gives up at once (``GenerationStopped``) instead of waiting vllm_server_timeout for one to return;
    not stopping, the same pool waits as before."""
    from posttrain.generation.types import GenerationStopped

    stopping = threading.Event()
    (only,) = servers(1)
    pool = ServerPool([only.url], 60.0, 5.0, 10.0, main=True, stopping=stopping.is_set)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    only.stop()
    threading.Timer(0.5, stopping.set).start()  # the signal comes while the call waits
    started = time.monotonic()
    with pytest.raises(GenerationStopped, match=f"every vLLM server is lost: {only.url} refused"):
        pool.complete(BODIES, "generating")
    assert time.monotonic() - started < 10  # not the 60 s of vllm_server_timeout


def test_a_stopping_process_does_not_wait_for_an_answer_a_closing_server_holds(
    servers: Any, tmp_path: Path
) -> None:
    """A server shutting down closes its port but holds the requests in flight unanswered: a process asked to
    stop gives them up once /health no longer answers, not after request_timeout; a server that still answers
    /health is waited for, stop or not."""
    from posttrain.generation.types import GenerationStopped

    stopping = threading.Event()
    (closing,) = servers(1)
    pool = ServerPool([closing.url], 60.0, 60.0, 10.0, main=True, stopping=stopping.is_set)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    closing.broken = "hold"
    stopping.set()
    started = time.monotonic()  # before the timer starts: its answer comes 3 s after this at the earliest
    threading.Timer(3.0, closing.held.set).start()  # answered (503) after 3 s: waited for while it answers
    with pytest.raises(GenerationStopped, match="every vLLM server is lost"):  # its 503, then no server
        pool.complete(BODIES[:1], "generating")
    assert time.monotonic() - started >= 3.0
    closing.held.clear()
    (other,) = servers(1)
    pool = ServerPool([other.url], 60.0, 60.0, 10.0, main=True, stopping=stopping.is_set)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-2")
    other.broken = "hold"
    threading.Timer(1.0, lambda: other.server.socket.close()).start()  # its port closes, the request held
    started = time.monotonic()
    with pytest.raises(GenerationStopped, match=f"{other.url} stopped answering while the run stops"):
        pool.complete(BODIES[:1], "generating")
    assert time.monotonic() - started < 15  # not request_timeout's 60 s
    other.held.set()


def test_a_server_absent_at_the_start_is_said_and_joins_later(
    servers: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (up,) = servers(1)
    late = servers(1)[0]
    late.stop()
    pool = pool_of([up.url, late.url], timeout=1.0)
    with caplog.at_level("WARNING", logger="posttrain"):
        pool.start(lambda client: "m")
    assert f"vLLM server at {late.url} did not answer within 1 s: the run starts without it" in caplog.text
    push(pool, tmp_path, "run-1")
    late.start()
    monkeypatch.setattr(server_pool, "LOOK_AGAIN", 0.0)
    pool.complete(BODIES, "generating")
    assert late.reloads == ["run-1"] and late.served == len(BODIES) // 2
    pool.close()


def test_a_lora_runs_adapter_is_loaded_under_its_tag_and_the_previous_one_dropped(
    servers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapter pushes go through vLLM's LoRA endpoints: each server holds the current adapter only; another
    rank sees which servers hold it in their model list; a server started again is given the current one."""
    first, second = servers(2)
    pool = ServerPool([first.url, second.url], 3.0, 5.0, 10.0, main=True, adapter=True)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    push(pool, tmp_path, "run-2")
    assert first.adapters == second.adapters == {"run-2"}
    bodies = [{**body, "model": pool.tag} for body in BODIES]
    assert len(pool.complete(bodies, "generating")) == len(BODIES)
    other = ServerPool([first.url, second.url], 3.0, 5.0, 10.0, main=False, adapter=True)
    other.confirm("run-2")
    assert [s.holds for s in other.servers] == ["run-2", "run-2"]
    second.stop()
    second.start()  # restarted: no adapter
    monkeypatch.setattr(server_pool, "LOOK_AGAIN", 0.0)
    pool.complete(bodies, "generating")
    assert second.adapters == {"run-2"} and second.served > 0
    pool.close(), other.close()


@pytest.mark.parametrize("broken", [500, "hang"])
def test_a_server_that_answers_health_but_fails_every_request_is_out_in_bounded_time(
    servers: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    broken: int | str,
) -> None:
    """It answers /health, then fails (HTTP 500) or times out every completion: after STRIKES failed requests in
    a row it is out for the rest of the run, reloaded at most that often; its requests go to the other server.
    Alone, the run stops in one line naming it, in bounded time, instead of reloading it in a loop."""
    monkeypatch.setattr(server_pool, "LOOK_AGAIN", 0.0)
    good, bad = servers(2)
    bad.broken = broken
    pool = pool_of([good.url, bad.url], request=0.5)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    with caplog.at_level("WARNING", logger="posttrain"):
        for _ in range(4):
            assert len(pool.complete(BODIES, "generating")) == len(BODIES)
    assert f"vLLM server at {bad.url} failed {server_pool.STRIKES} requests in a row" in caplog.text
    assert "out of the pool for the rest of the run" in caplog.text
    assert len(bad.reloads) <= server_pool.STRIKES and pool.servers[1].out
    reloads = len(bad.reloads)
    push(pool, tmp_path, "run-2")  # out for good: not given the next weights, not asked for them
    assert len(bad.reloads) == reloads and pool.servers[1].out and pool.servers[1].lost
    assert len(pool.complete(BODIES, "generating")) == len(BODIES)
    other = pool_of([good.url, bad.url], main=False)
    other.servers[1].out, other.servers[1].lost = True, "failed"
    other.confirm("run-2")
    assert other.servers[1].lost and other.servers[0].holds == "run-2"
    other.close()
    pool.close()

    (alone,) = servers(1)
    alone.broken = broken
    pool = pool_of([alone.url], timeout=30.0, request=0.5)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    started = time.monotonic()
    with pytest.raises(UserError) as caught:
        pool.complete(BODIES[:4], "generating")
    assert time.monotonic() - started < 20  # well under vllm_server_timeout: nothing can come back
    line = str(caught.value)
    assert "\n" not in line and alone.url in line, line
    assert (
        "every vLLM server of the run is out" in line or f"a request failed {server_pool.TRIES} times" in line
    )
    assert len(alone.reloads) <= server_pool.STRIKES
    pool.close()


def test_a_passing_failure_costs_nothing_and_a_request_is_tried_a_bounded_number_of_times(
    servers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_pool, "LOOK_AGAIN", 0.0)
    (flaky,) = servers(1)
    pool = pool_of([flaky.url])
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    flaky.fail_next = 1  # one 500, then it serves: the request is sent again once it rejoins
    assert len(pool.complete(BODIES[:1], "generating")) == 1
    assert flaky.failed == 1 and pool.servers[0].strikes == 0 and not pool.servers[0].lost
    pool.close()


def test_a_lora_server_back_after_a_passing_failure_keeps_its_adapter(
    servers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server that failed one request still holds the adapter: it is not sent again (vLLM answers 400
    "has already been loaded"); the run goes on."""
    monkeypatch.setattr(server_pool, "LOOK_AGAIN", 0.0)
    (server,) = servers(1)
    pool = ServerPool([server.url], 3.0, 5.0, 10.0, main=True, adapter=True)
    pool.start(lambda client: "m")
    push(pool, tmp_path, "run-1")
    server.fail_next = 1
    bodies = [{**body, "model": pool.tag} for body in BODIES[:2]]
    assert len(pool.complete(bodies, "generating")) == 2
    assert server.adapters == {"run-1"} and server.reloads == ["run-1"]
    pool.close()


def test_an_unemptied_prefix_cache_is_asked_again_then_one_line(servers: Any, tmp_path: Path) -> None:
    (server,) = servers(1)
    pool = pool_of([server.url])
    pool.start(lambda client: "m")
    server.unreset = 2  # blocks still held twice, then emptied
    push(pool, tmp_path, "run-1")
    assert server.reloads == ["run-1"]
    server.unreset = 100
    with pytest.raises(UserError) as caught:
        push(pool, tmp_path, "run-2")
    assert f"the vLLM server at {server.url} could not empty its prefix cache" in str(caught.value)
    pool.close()


class StubKind:
    """A kind of server that is not vLLM (``server_pool.ServerKind``): endpoints of its own for the weights
    (``/weights``, ``/tag``) and the completions (``/sample``). The pool's logic is the kind's whatever."""

    name = "stub server"

    def holds(self, client: server_pool.ServerClient, tag: str | None) -> str | None:
        return client.call("/tag", doing="saying which weights it holds")["tag"]

    def reload(
        self,
        client: server_pool.ServerClient,
        folder: Path,
        tag: str,
        previous: str | None,
        timeout: float,
        pushing: str,
    ) -> None:
        client.call("/weights", {"folder": str(folder), "tag": tag}, timeout, pushing)

    def complete(self, client: server_pool.ServerClient, body: dict[str, Any], doing: str) -> dict[str, Any]:
        return client.call("/sample", body, doing=doing)


class StubServer:
    """Speaks only StubKind's endpoints and /health; no vLLM route answers."""

    def __init__(self, port: int = 0) -> None:
        self.port, self.tag, self.served, self.reloads = port, None, 0, []
        self.start()

    def start(self) -> None:
        outer = self

        class Handler(_JsonHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    return self._json({})
                if self.path == "/tag":
                    return self._json({"tag": outer.tag})
                self.send_error(404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/weights":
                    outer.tag = body["tag"]
                    outer.reloads.append(body["tag"])
                    return self._json({"ok": True})
                if self.path == "/sample":
                    outer.served += 1
                    return self._json({"draw": [body["seed"], zlib.crc32(str(outer.tag).encode()) % 1000]})
                self.send_error(404)

        self.server = _Quiet(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = None  # started again: the weights are gone
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_pool_of_another_kind_of_server_loses_rejoins_and_pushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool with a stub kind (no vLLM endpoint): pushes reach every server, the requests are spread, a
    stopped server is lost and its requests go to the other, and when it answers again it is given the
    current weights and serves; the lines name the kind."""
    first, second = StubServer(), StubServer()
    pool = ServerPool([first.url, second.url], 3.0, 5.0, 10.0, main=True, kind=StubKind())
    try:
        pool.start(lambda client: "stub")
        push(pool, tmp_path, "run-1")
        bodies = [{"seed": i} for i in range(8)]
        answers = pool.complete(bodies, "generating")
        assert [a["draw"][0] for a in answers] == list(range(8)) and first.served == second.served == 4
        assert first.reloads == second.reloads == ["run-1"]

        second.stop()
        with caplog.at_level("WARNING", logger="posttrain"):
            answers = pool.complete(bodies, "generating")
        assert [a["draw"][0] for a in answers] == list(range(8)) and pool.lost_events == 1
        assert f"stub server at {second.url}" in caplog.text and "out of the pool" in caplog.text
        push(pool, tmp_path, "run-2")  # pushed while it is away: the other takes the weights
        assert first.reloads == ["run-1", "run-2"] and second.reloads == ["run-1"]

        second.start()  # back at its address, without weights
        monkeypatch.setattr(server_pool, "LOOK_AGAIN", 0.0)
        before = second.served
        with caplog.at_level("WARNING", logger="posttrain"):
            answers = pool.complete(bodies, "generating")
        assert second.reloads == ["run-1", "run-2"] and second.served > before and pool.rejoined_events == 1
        assert f"stub server at {second.url} is back with the current weights" in caplog.text
        assert len({a["draw"][1] for a in answers}) == 1  # every answer from the same weights
    finally:
        pool.close()
        first.stop()
        with contextlib.suppress(OSError):
            second.stop()
