"""Load shedding at the edge (lua/infergate/admission/shed.lua) with real nginx, Redis and
upstreams: all nodes saturated -> 429 + Retry-After within the wait bound; capacity
that comes back during the wait admits the request; the edge's own in-flight count at
max_concurrency sheds too; shedding off lets requests through."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import requests

from controlplane import procs
from controlplane.config import Settings
from support.stack import edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def settings(redis_url: str, nodes: list, **admission: Any) -> Settings:
    s = edge_settings(redis_url, nodes)
    for k, v in admission.items():
        setattr(s.admission, k, v)
    return s


def post(url: str, body: dict = CHAT, timeout: float = 15) -> requests.Response:
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def assert_shed(res: requests.Response, retry_after: int = 1) -> None:
    assert res.status_code == 429, res.text
    assert res.headers["Retry-After"] == str(retry_after)
    err = res.json()["error"]
    assert err["type"] == "server_overloaded" and err["code"] == "nodes_saturated"


def test_all_saturated_sheds_within_the_wait_bound(redis_server, tiny_upstreams, edge_factory) -> None:
    ups = tiny_upstreams(2)
    edge = edge_factory(settings(redis_server.url, [u.node_settings() for u in ups],
                                 max_wait_ms=1000, retry_after_s=2))
    r = redis_server.client()
    snap = write_snapshot(r, [u.snapshot_node(saturated=True, queue_depth=40) for u in ups])
    edge.wait_snapshot(snap["version"])

    for _ in range(2):
        started = time.monotonic()
        res = post(edge.url)
        elapsed = time.monotonic() - started
        assert_shed(res, retry_after=2)
        assert 0.95 <= elapsed < 2.5, elapsed  # waited for capacity, then answered: no timeout
    assert sum(u.hits for u in ups) == 0
    assert edge.status()["admission"]["shed"] == 2
    # GET /v1/models is not shed
    assert requests.get(f"{edge.url}/v1/models", timeout=10).status_code == 200

    # one node with room: admitted at once, and routed there
    snap = write_snapshot(r, [ups[0].snapshot_node(saturated=True), ups[1].snapshot_node()])
    edge.wait_snapshot(snap["version"])
    started = time.monotonic()
    res = post(edge.url)
    assert res.status_code == 200 and time.monotonic() - started < 0.5
    assert res.headers["X-Infergate-Node"] == ups[1].name


def test_capacity_returning_during_the_wait_admits(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], max_wait_ms=3000))
    r = redis_server.client()
    snap = write_snapshot(r, [up.snapshot_node(saturated=True)])
    edge.wait_snapshot(snap["version"])
    out: dict = {}

    def call() -> None:
        started = time.monotonic()
        out["res"] = post(edge.url)
        out["elapsed"] = time.monotonic() - started

    t = threading.Thread(target=call)
    t.start()
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 1, 5,
                     what="the request to wait for capacity")
    write_snapshot(r, [up.snapshot_node(saturated=False)])
    t.join(10)
    assert out["res"].status_code == 200, out["res"].text
    assert out["elapsed"] < 2.5
    st = edge.status()["admission"]
    assert st["shed"] == 0 and st["waiting"] == 0


def test_a_client_that_leaves_while_waiting_for_capacity_is_counted_out_at_once(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """Every node saturated, max_wait_ms long: a client that goes away while its request
    waits for capacity takes it out of the "waiting" gauge at that moment (the abort
    watch), not when its wait would have ended, and nothing reaches the node."""
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], max_wait_ms=20000))
    snap = write_snapshot(redis_server.client(), [up.snapshot_node(saturated=True)])
    edge.wait_snapshot(snap["version"])
    host, port = edge.url.removeprefix("http://").split(":")
    body = json.dumps(CHAT).encode()
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 1, 5,
                     what="the request to wait for capacity")
    s.close()
    left = time.monotonic()
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 0, 5, interval=0.02,
                     what="the request out of the waiting gauge")
    assert time.monotonic() - left < 2      # its wait had 20 s to run
    st = edge.status()["admission"]
    assert st["shed"] == 0 and up.hits == 0


def test_stale_snapshot_saturation_is_ignored(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    s = settings(redis_server.url, [up.node_settings()], max_wait_ms=200)
    s.edge.stale_after_s = 1.0
    edge = edge_factory(s)
    r = redis_server.client()
    snap = write_snapshot(r, [up.snapshot_node(saturated=True)], generated_at=time.time() - 5)
    edge.wait_snapshot(snap["version"])
    assert post(edge.url).status_code == 200


def test_inflight_at_max_concurrency_sheds(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    up.gate = threading.Event()
    up.chunks = 2
    edge = edge_factory(settings(redis_server.url, [up.node_settings(max_concurrency=1)],
                                 max_wait_ms=250))
    stream = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                           stream=True, timeout=15)
    try:
        assert stream.status_code == 200
        assert edge.node_status(up.name)["inflight"] == 1
        started = time.monotonic()
        assert_shed(post(edge.url))
        assert time.monotonic() - started < 1.5
        assert up.hits == 1
    finally:
        up.gate.set()
        stream.close()
    edge.wait_idle()
    assert post(edge.url).status_code == 200


def test_shedding_off_lets_requests_through(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], shed=False))
    r = redis_server.client()
    snap = write_snapshot(r, [up.snapshot_node(saturated=True)])
    edge.wait_snapshot(snap["version"])
    res = post(edge.url)
    assert res.status_code == 200
    assert edge.status()["admission"]["shed"] == 0


def test_cache_hit_is_served_while_every_node_is_saturated(redis_server, tiny_upstreams,
                                                           edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    s = settings(redis_server.url, [up.node_settings()], max_wait_ms=1000)
    s.cache.enabled = True
    s.cache.semantic = False
    edge = edge_factory(s)
    body = {"model": "tiny", "temperature": 0, "messages": [{"role": "user", "content": "cached?"}]}
    first = post(edge.url, body)
    assert first.status_code == 200, first.text
    procs.wait_until(lambda: post(edge.url, body).headers.get("X-Cache-Status") == "HIT", 5,
                     what="the answer to be stored in the cache")
    hits = up.hits

    r = redis_server.client()
    snap = write_snapshot(r, [up.snapshot_node(saturated=True)])
    edge.wait_snapshot(snap["version"])
    started = time.monotonic()
    res = post(edge.url, body)
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "HIT"
    assert time.monotonic() - started < 0.5, "a hit does not wait for capacity"
    assert res.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    # any other request is shed
    assert_shed(post(edge.url, {**body, "messages": [{"role": "user", "content": "new"}]}))
    assert up.hits == hits


def _one_waiting(redis_server, tiny_upstreams, edge_factory):
    """One node, saturated in the snapshot, and one request waiting for capacity (up to
    20 s) in a thread: (node, edge, redis client, out = {"res", "at"} once answered,
    the thread)."""
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], max_wait_ms=20000))
    r = redis_server.client()
    snap = write_snapshot(r, [up.snapshot_node(saturated=True)])
    edge.wait_snapshot(snap["version"])
    out: dict = {}

    def call() -> None:
        out["res"] = post(edge.url, timeout=30)
        out["at"] = time.monotonic()

    t = threading.Thread(target=call)
    t.start()
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 1, 5,
                     what="the request to wait for capacity")
    return up, edge, r, out, t


def test_a_request_waiting_for_capacity_gets_503_when_nginx_shuts_down(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """SIGQUIT (`nginx -s quit`, a stop of `infergate up`): a request waiting in admission
    is answered at once with 503 ``shutting_down`` and Retry-After, not held to the end of
    the shutdown and cut."""
    import signal

    up, edge, _, out, t = _one_waiting(redis_server, tiny_upstreams, edge_factory)
    quit_at = time.monotonic()
    edge.managed.signal(signal.SIGQUIT)
    t.join(15)
    res = out["res"]
    assert res.status_code == 503, res.text
    assert res.json()["error"]["code"] == "shutting_down" and res.headers["Retry-After"] == "1"
    assert out["at"] - quit_at < 3
    assert up.hits == 0
    edge.managed.proc.wait(timeout=10)  # and nginx is done: nothing of ours holds it


def test_a_request_waiting_for_capacity_waits_on_through_a_reload(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """A reload (SIGHUP, `nginx -s reload`; `infergate up` reloads when its embedder moves)
    is no shutdown: the old worker finishes what it holds, as nginx finishes its requests,
    and a request waiting there for capacity is served once a node has room, not answered
    503 shutting_down."""
    import signal

    up, edge, r, out, t = _one_waiting(redis_server, tiny_upstreams, edge_factory)
    edge.managed.signal(signal.SIGHUP)
    time.sleep(1.5)   # past the time an exiting worker waits for its successors
    assert "res" not in out, out["res"].text
    write_snapshot(r, [up.snapshot_node(saturated=False)])
    t.join(20)
    res = out["res"]
    assert res.status_code == 200, res.text
    assert up.hits == 1


def test_a_stream_running_when_nginx_shuts_down_ends_with_an_error_event(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """edge.shutdown_stream_s: a relayed stream still running that long after SIGQUIT
    ends with an SSE error event (``shutting_down``) and ``[DONE]``, not a silent cut
    when nginx is stopped outright later; nginx is then done."""
    import signal

    (up,) = tiny_upstreams(1)
    up.chunks, up.chunk_interval_s = 400, 0.05  # a 20 s stream
    s = settings(redis_server.url, [up.node_settings()])
    s.edge.shutdown_stream_s = 1.0
    edge = edge_factory(s)
    body = {**CHAT, "stream": True}
    res = requests.post(f"{edge.url}/v1/chat/completions", json=body, stream=True, timeout=30)
    assert res.status_code == 200
    lines = res.iter_lines(decode_unicode=True)
    got = [next(lines) for _ in range(4)]  # content is flowing
    quit_at = time.monotonic()
    edge.managed.signal(signal.SIGQUIT)
    got += list(lines)
    ended = time.monotonic() - quit_at
    events = [x[len("data: "):] for x in got if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "shutting_down", err
    assert 1.0 <= ended < 6, ended  # the bound (plus telling a shutdown from a reload)
    assert len(events) < 300  # cut short, not run to its end
    edge.managed.proc.wait(timeout=10)


def test_a_stream_runs_on_through_a_reload_whatever_the_shutdown_bound(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """A reload (SIGHUP) is not a shutdown: a stream the old worker holds goes on past
    edge.shutdown_stream_s to its own end."""
    import signal

    (up,) = tiny_upstreams(1)
    up.chunks, up.chunk_interval_s = 80, 0.05  # 4 s
    s = settings(redis_server.url, [up.node_settings()])
    s.edge.shutdown_stream_s = 0.5
    edge = edge_factory(s)
    res = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                        stream=True, timeout=30)
    lines = res.iter_lines(decode_unicode=True)
    got = [next(lines) for _ in range(4)]
    edge.managed.signal(signal.SIGHUP)
    got += list(lines)
    events = [x[len("data: "):] for x in got if x.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    assert len(events) >= 80
