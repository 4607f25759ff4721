"""Requests that are not streams, driven by the edge over cosockets (edge.answer_relay,
lua/infergate/stream/answer.lua) against tiny upstreams: one in flight on a node that
freezes is retried on another node well before its deadline (nginx's proxy path holds
it to the deadline), a long answer of a live node is waited on, connections to the
nodes are kept alive, and the node's answer reaches the client as the proxy path's."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from controlplane import procs
from support.stack import edge_on_snapshot, edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _post(edge, timeout: float = 30, **kw) -> requests.Response:
    return requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, **kw}, timeout=timeout)


def _pair(tiny_upstreams, redis_server, edge_factory, request_ms: int = 8000, **edge):
    a, b = tiny_upstreams(names=["a", "b"])
    s = edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                      outlier_ttfb_min_s=5.0, read_timeout_ms=60000, **edge)
    s.deadlines.request_ms = request_ms
    e = edge_factory(s)
    for _ in range(4):                       # both nodes answered: TTFB histories
        assert _post(e).status_code == 200
    return e, a, b


def _on_frozen(edge, a, b) -> tuple[requests.Response, float, int]:
    """With ``a`` frozen (it accepts connections, answers nothing, GETs included):
    :func:`_until_one_on` ``a``; ``a`` runs again afterwards."""
    a.mode = "frozen"
    try:
        return _until_one_on(edge, a, b)
    finally:
        a.mode = "ok"
        a.release()


def _until_one_on(edge, a, b, timeout: float = 30) -> tuple[requests.Response, float, int]:
    """Plain requests until one is sent to ``a``: (its answer, seconds, b's new requests
    meanwhile); fails after 16."""
    for _ in range(16):
        hits, b_hits, t0 = a.hits, b.hits, time.monotonic()
        res = _post(edge, timeout=timeout)
        if a.hits > hits:
            return res, time.monotonic() - t0, b.hits - b_hits
        assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "b", res.text
    raise AssertionError("no request was sent to a")


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "proxy"])
def test_a_request_on_a_node_that_froze_is_retried_before_its_deadline(
        tiny_upstreams, redis_server, edge_factory, relay: bool) -> None:
    """A plain request sent to a node frozen while idle (it accepts connections, answers
    nothing, GETs included): relayed, it is answered by the other node once two liveness
    checks of that silence got no answer (the early one after 1 s of quiet with its 1 s
    timeout, then the finding's own, 3 s: a busy host can miss one 1 s check of a live
    node whose long answer is nearly done), seconds before the 12 s deadline; on nginx's
    proxy path it waits for the deadline and gets 504."""
    edge, a, b = _pair(tiny_upstreams, redis_server, edge_factory, request_ms=12000,
                       answer_relay=relay)
    res, took, on_b = _on_frozen(edge, a, b)
    if relay:
        assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "b", res.text
        assert on_b == 1 and res.json()["system_fingerprint"] == "b"
        # quiet 1 s, the early check's 1 s, the finding's check's 3 s, the relay's next
        # look (0.5 s); not the deadline
        assert took < 9.0, f"the request waited {took:.1f} s on the frozen node"
        assert "no answer to a liveness check" in edge.error_log()
        # the access log names both tries, with a status (504: the frozen node timed
        # out) and a time each, as nginx's proxy logs its own retries
        line = _log_line(edge, res)
        assert f'ua="{a.host}:{a.port}, {b.host}:{b.port}"' in line, line
        assert re.search(r'us="504, 200" urt="\d+\.\d{3}, \d+\.\d{3}"', line), line
    else:
        assert res.status_code == 504 and res.json()["error"]["code"] == "deadline_exceeded"
        assert took >= 11.5 and on_b == 0


def test_a_request_on_a_frozen_node_goes_to_a_node_back_meanwhile(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """The other node of the model is unhealthy when a plain request is sent: the request
    is still relayed and watched, and when its node froze and the other is back before
    the deadline (8 s), it is answered there once two liveness checks got no answer, not
    after the 10 s read of a leg with no other node at its start (on nginx's proxy path
    it waited for the deadline: 504)."""
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_on_snapshot(redis_server, edge_factory,
                            [a.snapshot_node(), b.snapshot_node(healthy=False)],
                            request_ms=8000, outlier_ttfb_min_s=5.0)
    a.mode = "frozen"
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_post, edge)
            procs.wait_until(lambda: a.hits == 1, 5, what="the request on a")
            snap = write_snapshot(redis_server.client(), [a.snapshot_node(), b.snapshot_node()])
            edge.wait_snapshot(snap["version"])
            res = fut.result(timeout=20)
    finally:
        a.mode = "ok"
        a.release()
    assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "b", res.text
    assert b.hits == 1 and res.json()["system_fingerprint"] == "b"


def _log_line(edge, res: requests.Response) -> str:
    rid = res.headers["X-Request-Id"]
    for _ in range(50):                      # the log phase writes after the answer
        lines = [ln for ln in edge.access_log().splitlines() if f"rid={rid}" in ln]
        if lines:
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(f"no access log line for {rid}")


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "proxy"])
def test_the_access_log_has_the_nodes_status_and_time(tiny_upstreams, redis_server,
                                                      edge_factory, relay: bool) -> None:
    """A request the edge relays itself is logged like one nginx proxied: the node's
    address, its status and its response time (us=, urt=), for plain requests and
    streams alike."""
    edge, a, b = _pair(tiny_upstreams, redis_server, edge_factory, answer_relay=relay,
                       stream_relay=relay)
    addrs = {"a": f"{a.host}:{a.port}", "b": f"{b.host}:{b.port}"}
    for stream in (False, True):
        res = _post(edge, stream=stream)
        assert res.status_code == 200, res.text
        line = _log_line(edge, res)
        node = res.headers["X-Infergate-Node"]
        assert f'ua="{addrs[node]}" us="200" ' in line, line
        assert re.search(r' urt="\d+\.\d{3}" ', line), line


def test_a_long_answer_of_a_live_node_is_waited_on(tiny_upstreams, redis_server,
                                                  edge_factory) -> None:
    """A node that takes longer than its TTFB threshold's floor (5 s) for a whole answer
    but answers its liveness checks is not left: its own answer comes back, and the
    other node gets nothing."""
    edge, a, b = _pair(tiny_upstreams, redis_server, edge_factory, request_ms=20000)
    a.delay_s = 6.0
    res, took, on_b = _until_one_on(edge, a, b)
    assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "a", res.text
    assert on_b == 0 and took >= 6.0 and a.gets > 0, (on_b, took, a.gets)


def test_connections_to_the_nodes_are_kept_alive(tiny_upstreams, redis_server,
                                                edge_factory) -> None:
    """Sequential plain requests of one worker reuse one connection per node, as the
    proxy path's upstream keepalive does; a stream's connection is not kept. The
    answer's own headers, length and body reach the client unchanged. Connections that
    carried a request are counted: on a loaded host a request may wait past
    edge.liveness_suspect_s for its first byte, and the early liveness check's
    GET /health has a connection of its own."""
    ups = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups],
                                      workers=1))
    for _ in range(10):
        res = _post(edge)
        assert res.status_code == 200, res.text
        node = res.headers["X-Infergate-Node"]
        assert res.headers["X-Sim-Node"] == node and node in ("a", "b")
        assert int(res.headers["Content-Length"]) == len(res.content)
        assert res.json()["choices"][0]["message"]["content"] == f"hello from {node}"
    assert sum(u.hits for u in ups) == 10
    assert [u.post_connections for u in ups] == [min(u.hits, 1) for u in ups]
    conns, hits = sum(u.post_connections for u in ups), sum(u.hits for u in ups)
    assert _post(edge, stream=True).status_code == 200
    tries = sum(u.hits for u in ups) - hits
    # every try of the stream on a connection of its own, none on a kept one (a try
    # may be retried on the other node when a host short of CPU delays the first byte
    # past the early liveness check)
    assert tries >= 1 and sum(u.post_connections for u in ups) - conns == tries
    for u in ups:
        assert edge.node_status(u.name)["failures"] == 0


@contextlib.contextmanager
def _one_answer_node(status: int, ctype: str, body: bytes,
                     protocol: str = "HTTP/1.1", seen: list | None = None) -> Iterator[str]:
    """A node on a free port answering every POST with ``status``, ``ctype`` and
    ``body`` (with its Content-Length) in ``protocol``; yields its URL. ``seen`` gets one
    entry per connection accepted."""
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = protocol

        def log_message(self, *args) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            if seen is not None:
                seen.append(1)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", procs.free_port()), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        th.join(5)


@pytest.mark.parametrize("status,ctype,text", [
    (400, "text/plain", b"bad things"),
    (503, "text/html", b"<html>down</html>"),
])
def test_an_error_answer_that_is_not_json_is_wrapped(redis_server, edge_factory, status: int,
                                                    ctype: str, text: bytes) -> None:
    """A node's error answer that is not JSON (a proxy's HTML page, plain text) reaches
    the client as an OpenAI-style JSON error with the same status, as on the proxy path
    (infergate.filters)."""
    with _one_answer_node(status, ctype, text) as x, _one_answer_node(status, ctype, text) as y:
        edge = edge_factory(edge_settings(redis_server.url, [{"name": "x", "url": x},
                                                             {"name": "y", "url": y}]))
        res = _post(edge)
    assert res.status_code == status and res.headers["Content-Type"] == "application/json"
    err = res.json()["error"]
    node = res.headers["X-Infergate-Node"]
    assert err["code"] == "upstream_error" and f"Node {node} answered {status}" in err["message"]
    assert text.decode() in err["message"], err


def test_an_answer_longer_than_the_relay_keeps_is_passed_on_whole(redis_server,
                                                                 edge_factory) -> None:
    """An answer longer than the relay reads before passing it on (16 MB) goes to the
    client as it comes, whole, with the node's Content-Length."""
    content = "x" * (17 * 1024 * 1024)
    body = json.dumps({"id": "big", "object": "chat.completion", "choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": content}}]}).encode()
    with _one_answer_node(200, "application/json", body) as x, \
            _one_answer_node(200, "application/json", body) as y:
        edge = edge_factory(edge_settings(redis_server.url, [{"name": "x", "url": x},
                                                             {"name": "y", "url": y}],
                                          workers=1))
        got = [_post(edge, timeout=60) for _ in range(4)]   # kept connections work too
    for res in got:
        assert res.status_code == 200 and int(res.headers["Content-Length"]) == len(body)
        assert res.content == body and res.headers["X-Infergate-Node"] in ("x", "y")


def test_an_http10_node_is_not_kept_alive(redis_server, edge_factory) -> None:
    """A node answering HTTP/1.0 without keep-alive closes each connection: every
    request gets a connection of its own, none fails or counts against the node."""
    body = json.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": "ok"}}]}).encode()
    seen: list = []
    with _one_answer_node(200, "application/json", body, "HTTP/1.0", seen) as x, \
            _one_answer_node(200, "application/json", body, "HTTP/1.0", seen) as y:
        edge = edge_factory(edge_settings(redis_server.url, [{"name": "x", "url": x},
                                                             {"name": "y", "url": y}],
                                          workers=1))
        got = [_post(edge) for _ in range(6)]
    assert [r.status_code for r in got] == [200] * 6 and all(r.content == body for r in got)
    assert len(seen) == 6
    assert edge.node_status("x")["failures"] == 0 and edge.node_status("y")["failures"] == 0


def test_with_one_node_a_request_keeps_the_proxy_path(tiny_upstreams, redis_server,
                                                     edge_factory) -> None:
    """With one node serving the model there is nowhere to retry: a plain request goes
    through nginx's proxy path (its Host is the upstream's name), a stream through the
    relay (the node's address); the access log has the node's status for both."""
    (a,) = tiny_upstreams(names=["a"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()], workers=1))
    assert _post(edge).status_code == 200
    assert _post(edge, stream=True).status_code == 200
    procs.wait_until(lambda: edge.access_log().count("POST /v1/chat") == 2, 5, what="log")
    plain, stream = [ln for ln in edge.access_log().splitlines() if "POST /v1/chat" in ln]
    assert 'us="200"' in plain and 'us="200"' in stream, (plain, stream)
    assert a.hits == 2
    assert [h["Host"] for h in a.headers_seen] == ["infergate_nodes", a.host]


def _leave_one(edge, ups) -> None:
    """One plain request whose client leaves (1 s) while a node of ``ups`` works."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_post, edge, 1.0)
        procs.wait_until(lambda: sum(u.inflight for u in ups) == 1, 5, what="the request")
        with pytest.raises(requests.exceptions.ReadTimeout):
            fut.result(timeout=10)


def test_a_client_that_leaves_frees_the_node(tiny_upstreams, redis_server, edge_factory) -> None:
    """A plain request whose client leaves while the node works ends at once, its
    in-flight count freed."""
    ups = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups],
                                      workers=1))
    for u in ups:
        u.mode = "hang"
    try:
        _leave_one(edge, ups)
        procs.wait_until(lambda: all(edge.node_status(u.name)["inflight"] == 0 for u in ups),
                         10, what="the edge to free the node")
        assert sum(u.hits for u in ups) == 1
    finally:
        for u in ups:
            u.mode = "ok"
            u.release()


@pytest.mark.parametrize("source", ["server", "config"])
def test_a_llamacpp_node_keeps_its_slot_counted_after_the_client_left(
        tiny_upstreams, redis_server, edge_factory, source: str) -> None:
    """llama-server goes on with an answer that is not a stream after its client's
    connection closed. For a llama.cpp server (slots_source "server": it answered
    /props) the edge reads the answer to its end when the client leaves, so the node's
    in-flight count (its slot) stays taken while it works; a node of another kind gets
    its connection closed at once (vLLM stops the work then) and the count is freed."""
    ups = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [], stale_after_s=3600, workers=1))
    snap = write_snapshot(redis_server.client(), [
        u.snapshot_node(kind="openai", slots=2, slots_source=source, score=None,
                        has_metrics=False) for u in ups])
    edge.wait_snapshot(snap["version"])
    for u in ups:
        u.delay_s = 3.0
    _leave_one(edge, ups)
    node = next(u for u in ups if u.inflight == 1)
    if source == "server":
        t0 = time.monotonic()
        while node.inflight == 1:     # the node works: its slot stays counted
            assert edge.node_status(node.name)["inflight"] == 1
            assert time.monotonic() - t0 < 5
            time.sleep(0.1)
    procs.wait_until(lambda: edge.node_status(node.name)["inflight"] == 0, 10,
                     what="the count freed")
    if source == "config":
        assert node.inflight == 1, "freed only once the node finished"
    # logged as a cancel, as nginx's proxy logs one
    procs.wait_until(lambda: '" 499 ' in edge.access_log(), 10, what="499 in the access log")
    assert '" 444 ' not in edge.access_log()


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "no-slots"])
def test_past_the_deadline_llamacpp_slots_stay_counted_until_slots_shows_them_done(
        tiny_upstreams, redis_server, edge_factory, slots: bool) -> None:
    """Answers that are not streams past their deadline on llama.cpp nodes (they work on
    after the 504 closed the connection): each node's in-flight count stays at what the
    server still runs, as its /slots shows (two answers held on a node go back one by
    one as they finish), and goes back at once for a server whose /slots does not
    answer."""
    ups = tiny_upstreams(names=["a", "b"])
    s = edge_settings(redis_server.url, [], stale_after_s=3600, workers=1,
                      read_timeout_ms=60000)
    s.deadlines.request_ms = 1000
    edge = edge_factory(s)
    snap = write_snapshot(redis_server.client(), [
        u.snapshot_node(kind="openai", slots=2, slots_source="server", score=None,
                        has_metrics=False) for u in ups])
    edge.wait_snapshot(snap["version"])
    for u in ups:
        u.slots = 2 if slots else 0
        u.mode = "hang"
    try:
        # at once: all four run before the first 504 (a request sent while a count is
        # held may not show in /slots yet, see slothold)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: _post(edge, timeout=10), range(4)))
        assert [r.status_code for r in got] == [504] * 4, [r.text for r in got]
        if not slots:
            procs.wait_until(lambda: all(edge.node_status(u.name)["inflight"] == 0
                                         for u in ups), 5, what="the counts given back")
            return
        assert [u.inflight for u in ups] == [2, 2]
        time.sleep(1.5)                  # three polls of /slots: nothing is done yet
        assert [edge.node_status(u.name)["inflight"] for u in ups] == [2, 2]
        ups[0].slots_busy = 1            # one of a's answers is done
        procs.wait_until(lambda: edge.node_status("a")["inflight"] == 1, 5,
                         what="one of a's counts given back")
        assert edge.node_status("b")["inflight"] == 2
    finally:
        for u in ups:
            u.mode, u.slots_busy = "ok", None
            u.release()
    procs.wait_until(lambda: all(edge.node_status(u.name)["inflight"] == 0 for u in ups), 5,
                     what="every count given back")


def test_a_node_that_resumes_after_a_freeze_gets_requests_again(tiny_upstreams, redis_server,
                                                                edge_factory) -> None:
    """A node found frozen by the early liveness check (its request moved to the other
    node) that answers a later check gets requests again (one at a time until its first
    answer), not none until its outlier flag expires (3 x its 5 s threshold): no request
    stays on it to clear the flag with its answer, as on nginx's proxy path."""
    edge, a, b = _pair(tiny_upstreams, redis_server, edge_factory)
    res, _, on_b = _on_frozen(edge, a, b)
    assert res.status_code == 200 and on_b == 1, res.text
    procs.wait_until(lambda: "node a answers its liveness check" in edge.error_log(), 10,
                     what="a's answer to a liveness check")
    b.delay_s = 1.0                          # b busy: a is the cheaper pick
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: _post(edge), range(4)))
    assert [r.status_code for r in got] == [200] * 4, [r.text for r in got]
    nodes = [r.headers["X-Infergate-Node"] for r in got]
    assert "a" in nodes, f"every request went to the busy b: {nodes}"
    assert not edge.node_status("a")["outlier"]


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "proxy"])
def test_a_header_the_node_sends_twice_reaches_the_client_twice(redis_server, edge_factory,
                                                                relay: bool) -> None:
    """Two Set-Cookie (or Vary) headers of the node's answer both reach the client, as
    nginx's proxy passes them; the relay kept only the last."""
    body = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Set-Cookie", "a=1")
            self.send_header("Set-Cookie", "b=2")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srvs = [http.server.ThreadingHTTPServer(("127.0.0.1", procs.free_port()), Handler)
            for _ in range(2)]            # two nodes: a relayed answer
    ths = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in srvs]
    for th in ths:
        th.start()
    try:
        edge = edge_factory(edge_settings(redis_server.url, [
            {"name": f"n{i}", "url": f"http://127.0.0.1:{srv.server_address[1]}"}
            for i, srv in enumerate(srvs)], answer_relay=relay))
        res = _post(edge)
    finally:
        for srv, th in zip(srvs, ths):
            srv.shutdown()
            srv.server_close()
            th.join(5)
    assert res.status_code == 200, res.text
    assert res.raw.headers.getlist("Set-Cookie") == ["a=1", "b=2"], res.raw.headers


ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "finish_reason": "stop",
     "message": {"role": "assistant", "content": "ok"}}]}).encode()


@contextlib.contextmanager
def _raw_nodes(head: bytes, body: bytes = ANSWER, close: bool = True, pause_s: float = 0,
               seen: list | None = None, read: bool = True) -> Iterator[list[dict]]:
    """Two nodes on free ports answering every POST with the bytes ``head`` (status line
    and header lines, without the blank line; ``pause_s`` between the status line and
    the rest) and ``body``, then closing the connection (``close``) or waiting for the
    next request on it; yields their node settings. ``seen`` gets one entry per POST;
    without ``read`` the request's body is not read (the answer comes before it)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            if read:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if seen is not None:
                seen.append(1)
            data = head + b"\r\n\r\n" + body
            if pause_s:
                cut = data.index(b"\r\n") + 2
                self.wfile.write(data[:cut])
                self.wfile.flush()
                time.sleep(pause_s)
                data = data[cut:]
            self.wfile.write(data)
            self.close_connection = close

    srvs = [http.server.ThreadingHTTPServer(("127.0.0.1", procs.free_port()), Handler)
            for _ in range(2)]
    ths = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in srvs]
    for th in ths:
        th.start()
    try:
        yield [{"name": f"n{i}", "url": f"http://127.0.0.1:{srv.server_address[1]}"}
               for i, srv in enumerate(srvs)]
    finally:
        for srv, th in zip(srvs, ths):
            srv.shutdown()
            srv.server_close()
            th.join(5)


def _ok_head(*lines: str) -> bytes:
    return "\r\n".join(("HTTP/1.1 200 OK", "Content-Type: application/json")
                       + lines).encode()


@pytest.mark.parametrize("interim", [
    "HTTP/1.1 100 Continue\r\n\r\n",
    "HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
    "HTTP/1.1 100 Continue\r\n\r\n",
], ids=["100", "103+100"])
def test_interim_answers_before_the_answer_are_skipped(redis_server, edge_factory,
                                                       interim: str) -> None:
    """A node that sends 1xx interim answers (100 Continue, 103 Early Hints) before its
    answer, as HTTP/1.1 allows, and keeps its connection open, is answered at once with
    its final answer; the relay took the 1xx for the answer, read its body until the
    node closed (the read timeout on each node) and answered 504, both nodes blamed."""
    head = interim.encode() + _ok_head(f"Content-Length: {len(ANSWER)}", "X-Final: yes")
    with _raw_nodes(head, close=False) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes))
        t0 = time.monotonic()
        res = _post(edge, timeout=40)
        took = time.monotonic() - t0
    assert res.status_code == 200 and res.content == ANSWER, (res.status_code, res.text)
    assert res.headers["X-Final"] == "yes" and "Link" not in res.headers
    assert took < 5, f"{took:.1f} s"
    for n in nodes:
        assert edge.node_status(n["name"])["failures"] == 0


def test_header_lines_that_come_after_the_status_line_are_waited_for(
        redis_server, edge_factory) -> None:
    """A node whose header lines come a second after its status line is waited for (it
    answered): the relay gave up on it after 0.5 s (its watch of a silent node), counted
    a failure against it and sent the request to the other node."""
    seen: list = []
    with _raw_nodes(_ok_head(f"Content-Length: {len(ANSWER)}"), pause_s=1.0,
                    seen=seen) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes))
        res = _post(edge)
        assert res.status_code == 200 and res.content == ANSWER, res.text
        assert len(seen) == 1, "the request was sent to both nodes"
        assert sum(edge.node_status(n["name"])["failures"] for n in nodes) == 0


@pytest.mark.parametrize("lengths", [
    ["abc"], ["-5"], ["0x10"], ["+44"], [""], ["44", "5"], ["44, 5"],
], ids=["word", "negative", "hex", "plus", "empty", "two-headers", "list"])
def test_an_answer_with_an_invalid_content_length_is_not_passed_on(
        redis_server, edge_factory, lengths: list[str]) -> None:
    """A node's answer whose Content-Length is not a length (or two different ones) has
    no known end: it is an invalid answer (502 upstream_invalid_answer after the other
    node, as nginx's proxy treats an invalid header), never an empty or cut 200 (the
    relay read "abc" as 0 and "0x10" as 16 bytes) nor a Lua error ("-5": 500)."""
    head = _ok_head(*(f"Content-Length: {v}" for v in lengths))
    with _raw_nodes(head) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes))
        res = _post(edge)
    assert res.status_code == 502, (res.status_code, res.text)
    assert res.json()["error"]["code"] == "upstream_invalid_answer", res.text
    assert "runtime error" not in edge.error_log()


@pytest.mark.parametrize("lengths", [["244, 244"], ["244", "244"]], ids=["list", "twice"])
def test_a_content_length_sent_twice_with_one_value_is_the_length(
        redis_server, edge_factory, lengths: list[str]) -> None:
    """One length sent twice (in a list or two header lines) is that length (RFC 9110
    8.6): the whole answer reaches the client (the relay read "244, 244" as 0 bytes)."""
    body = ANSWER.ljust(244)
    head = _ok_head(*(f"Content-Length: {v}" for v in lengths))
    with _raw_nodes(head, body) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes))
        res = _post(edge)
    assert res.status_code == 200 and res.content == body, (res.status_code, res.text)


def test_a_folded_header_line_is_an_invalid_answer(redis_server, edge_factory) -> None:
    """A header line folded onto the next (obs-fold, RFC 9112 5.2), as nginx's proxy
    finds it: an invalid answer, 502, not a header whose name starts with a space."""
    head = _ok_head(f"Content-Length: {len(ANSWER)}", "X-Folded: first", " more: part")
    with _raw_nodes(head) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes))
        res = _post(edge)
    assert res.status_code == 502, (res.status_code, res.text)
    assert res.json()["error"]["code"] == "upstream_invalid_answer", res.text


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "proxy"])
def test_the_nodes_cache_control_reaches_the_client(redis_server, edge_factory,
                                                   relay: bool) -> None:
    """The node's Cache-Control header reaches the client, as nginx's proxy passes it;
    the relay dropped it."""
    head = _ok_head(f"Content-Length: {len(ANSWER)}", "Cache-Control: private, max-age=5")
    with _raw_nodes(head) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes, answer_relay=relay))
        res = _post(edge)
    assert res.status_code == 200 and res.content == ANSWER, res.text
    assert res.headers["Cache-Control"] == "private, max-age=5"


def test_a_long_chunked_answer_goes_on_without_a_content_length(redis_server,
                                                                edge_factory) -> None:
    """An answer longer than the relay keeps (16 MB) sent chunked, with a Content-Length
    as well (which chunked framing overrides, RFC 9112 6.3), reaches the client whole:
    the relay passed that Content-Length on and the client read only that much."""
    content = "y" * (17 * 1024 * 1024)
    body = json.dumps({"id": "big", "object": "chat.completion", "choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": content}}]}).encode()
    step = 1 << 20
    chunked = b"".join(b"%x\r\n" % len(body[i:i + step]) + body[i:i + step] + b"\r\n"
                       for i in range(0, len(body), step)) + b"0\r\n\r\n"
    head = _ok_head("Transfer-Encoding: chunked", "Content-Length: 100")
    with _raw_nodes(head, chunked) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes))
        res = _post(edge, timeout=60)
    assert res.status_code == 200 and res.content == body, (res.status_code, len(res.content))


def test_an_answer_the_node_sends_before_reading_a_long_body_is_passed_on(
        redis_server, edge_factory) -> None:
    """A node that refuses a long request at once (413, before reading its body) and
    closes the connection (reset: the body unread) has its answer passed on, as nginx's
    proxy reads it while it sends: the relay stopped at the failed send, tried the other
    node, and answered 502 with both nodes blamed."""
    err = b'{"error":{"message":"too large","type":"invalid_request_error"}}'
    head = ("HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(err)}").encode()
    with _raw_nodes(head, err, read=False) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes))
        res = _post(edge, messages=[{"role": "user", "content": "x" * (7 << 20)}])
        assert res.status_code == 413 and res.content == err, (res.status_code, res.text)
        assert sum(edge.node_status(n["name"])["failures"] for n in nodes) == 0


def test_two_cookie_lines_of_the_client_reach_the_node_as_one_cookie_list(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A client's two Cookie lines reach the node as one Cookie header of both cookies
    ("a=1; b=2", RFC 6265 5.4); the relay joined them with a comma, which makes one
    cookie "a" of value "1, b=2"."""
    ups = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups]))
    host, port = edge.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps(CHAT)
    conn.putrequest("POST", "/v1/chat/completions")
    for name, value in (("Content-Type", "application/json"), ("Cookie", "a=1"),
                        ("Cookie", "b=2"), ("Content-Length", str(len(body)))):
        conn.putheader(name, value)
    conn.endheaders(body.encode())
    res = conn.getresponse()
    assert res.status == 200, res.read()
    conn.close()
    seen = [h for u in ups for h in u.headers_seen if "Cookie" in h]
    assert [h["Cookie"] for h in seen] == ["a=1; b=2"], seen


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "proxy"])
@pytest.mark.parametrize("status", [204, 304])
def test_an_answer_without_a_body_gets_no_length_or_type(redis_server, edge_factory,
                                                         relay: bool, status: int) -> None:
    """A node's 204 or 304 reaches the client without a Content-Length (a server must
    not send one with a 204, RFC 9110 8.6) or a Content-Type the node did not send, as
    nginx's proxy passes it; the relay added "Content-Length: 0" and, to a 304,
    "Content-Type: application/json"."""
    head = f"HTTP/1.1 {status} X\r\nETag: \"e1\"".encode()
    with _raw_nodes(head, b"", close=False) as nodes:
        edge = edge_factory(edge_settings(redis_server.url, nodes, answer_relay=relay))
        host, port = edge.url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            body = json.dumps(CHAT).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                      % len(body) + body)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
    lines = raw.split(b"\r\n\r\n")[0].decode().split("\r\n")
    names = [ln.split(":")[0].lower() for ln in lines[1:]]
    assert lines[0].startswith(f"HTTP/1.1 {status}"), lines
    assert "content-length" not in names and "content-type" not in names, lines
    assert 'ETag: "e1"' in lines
