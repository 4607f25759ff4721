"""Failing, hanging, refusing, busy and garbage-speaking nodes behind the edge: client
requests are retried on other nodes, circuit breakers open, probe one at a time and
close again, in-flight counters come back to zero (also after client aborts), and
when nothing can answer the client gets an OpenAI-style JSON 502/503."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from controlplane import procs
from support.stack import edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _post(edge, timeout: float = 15, **kw) -> requests.Response:
    return requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, **kw}, timeout=timeout)


def _ok_nodes(edge, n: int, workers: int = 1) -> Counter:
    """n requests that must all succeed; the nodes that served them."""
    def one(_: int) -> str:
        res = _post(edge)
        assert res.status_code == 200, res.text
        return res.headers["X-Infergate-Node"]

    with ThreadPoolExecutor(workers) as pool:
        return Counter(pool.map(one, range(n)))


def _json_error(res: requests.Response, status: int) -> dict:
    assert res.status_code == status, res.text
    assert res.headers["Content-Type"] == "application/json"
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.fixture
def pool(tiny_upstreams, redis_server, edge_factory):
    """Three tiny nodes a, b, c, routed on a fresh snapshot where all score 0 (so the
    circuit breaker, not the local failure rate, keeps failing nodes out); fast breaker."""
    def make(**edge):
        ups = tiny_upstreams(names=["a", "b", "c"])
        opts = {"breaker_failures": 3, "breaker_cooldown_s": 1.0, "stale_after_s": 120.0, **edge}
        e = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups], **opts))
        snap = write_snapshot(redis_server.client(), [u.snapshot_node(score=0.0) for u in ups])
        e.wait_snapshot(snap["version"])
        return e, ups
    return make


def test_failing_node_is_avoided_breaker_opens_and_recovers(pool) -> None:
    edge, (a, b, c) = pool()
    a.mode = "fail"
    served = _ok_nodes(edge, 40)
    assert "a" not in served and sum(served.values()) == 40
    st = edge.node_status("a")
    assert st["breaker"] in ("open", "half_open") and st["failures"] >= 3
    assert a.hits <= 3 + 2, "after 3 failures only the odd half-open probe reaches it"
    # recovery: after the cooldown one probe succeeds and the node is back in the pool
    a.mode = "ok"
    procs.wait_until(lambda: "a" in _ok_nodes(edge, 6), 15, interval=0.2, what="a serving again")
    assert edge.node_status("a")["breaker"] == "closed"
    assert "circuit breaker of node a opened" in edge.error_log()
    assert "circuit breaker of node a closed" in edge.error_log()


def test_half_open_admits_exactly_one_probe(pool) -> None:
    edge, (a, b, c) = pool(read_timeout_ms=1500)
    a.mode = "fail"
    _ok_nodes(edge, 20)
    # the picks are random: keep sending until a has drawn its 3 failures
    procs.wait_until(lambda: edge.node_status("a")["breaker"] in ("open", "half_open")
                     or not _ok_nodes(edge, 1), 10, what="breaker open")
    assert edge.node_status("a")["breaker"] in ("open", "half_open")
    a.mode = "hang"  # the probe will hang until the read timeout
    procs.wait_until(lambda: edge.node_status("a")["breaker"] == "half_open", 5, what="cooldown over")
    before = a.hits
    served = _ok_nodes(edge, 12, workers=6)
    assert sum(served.values()) == 12
    assert a.hits - before == 1, "one probe, the rest went elsewhere"
    assert edge.node_status("a")["breaker"] in ("open", "half_open")
    assert "reopened (probe failed)" in edge.error_log()


def test_a_node_seen_back_since_its_breaker_opened_is_probed_at_once(pool, redis_server) -> None:
    """A server killed and started again: the breaker its failures opened would keep
    the new process idle for the whole cooldown (30 s here) while other nodes are left.
    Once the control plane saw the node come back after the opening (the snapshot's
    ``back_at``), the next request is its half-open probe, and it serves again."""
    edge, ups = pool(breaker_failures=3, breaker_cooldown_s=30.0)
    a = ups[0]
    a.mode = "fail"
    procs.wait_until(lambda: edge.node_status("a")["breaker"] == "open"
                     or not _ok_nodes(edge, 3), 10, what="a's breaker open")
    opened = time.time()
    a.mode = "ok"
    before = a.hits
    assert "a" not in _ok_nodes(edge, 12) and a.hits == before, "open: a gets nothing"
    # a snapshot that saw a back before its breaker opened changes nothing
    snap = write_snapshot(redis_server.client(), [
        u.snapshot_node(score=0.0, back_at=opened - 5 if u is a else None) for u in ups])
    edge.wait_snapshot(snap["version"])
    assert "a" not in _ok_nodes(edge, 6) and a.hits == before
    snap = write_snapshot(redis_server.client(), [
        u.snapshot_node(score=0.0, back_at=time.time() if u is a else None) for u in ups])
    edge.wait_snapshot(snap["version"])
    assert _ok_nodes(edge, 1) == Counter({"a": 1}), "the next request is a's probe"
    assert edge.node_status("a")["breaker"] == "closed"
    assert "circuit breaker of node a closed (probe succeeded)" in edge.error_log()
    assert time.time() - opened < 30


@pytest.mark.parametrize("relay", [True, False], ids=["stream_relay", "proxied_stream"])
def test_a_probe_that_streams_closes_the_breaker_at_its_response_head(pool, relay) -> None:
    """A half-open probe that is a long stream: the breaker closes once the node answers
    200, not when the stream ends, so the recovered node takes other requests meanwhile
    (before, nothing else reached it for the stream's whole length). Stall detection is
    off (the held stream sends nothing, which on a loaded host outlasts its 1.5 s floor),
    and the nodes are ranked by requests in flight alone (node_cost "load"): b and c,
    made slow, carry more than a's one held stream, so a is the least loaded whatever
    the learned speeds of a loaded host say."""
    edge, (a, b, c) = pool(stream_relay=relay, stream_hold_s=0.0, stall_gap_factor=0.0,
                           node_cost="load")
    a.mode = "fail"
    procs.wait_until(lambda: _post(edge).status_code == 200
                     and edge.node_status("a")["breaker"] in ("open", "half_open"), 15,
                     interval=0.05, what="a's breaker open")
    a.mode = "ok"
    a.gate = threading.Event()              # a's streams wait before their last chunk
    procs.wait_until(lambda: edge.node_status("a")["breaker"] == "half_open", 5,
                     what="cooldown over")
    streams: list[threading.Thread] = []

    def stream() -> None:
        with requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                           stream=True, timeout=30) as res:
            for _ in res.iter_content(None):
                pass

    def probe_on_a() -> bool:
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        streams.append(t)
        procs.wait_until(lambda: a.inflight >= 1 or not t.is_alive(), 5, interval=0.02,
                         what="stream done")
        return a.inflight >= 1

    try:
        procs.wait_until(probe_on_a, 15, interval=0.0, what="the probe stream on a")
        procs.wait_until(lambda: edge.node_status("a")["breaker"] == "closed", 5,
                         interval=0.05, what="the breaker closed by the probe's head")
        assert a.inflight == 1                            # the probe still streams
        before = a.hits
        b.delay_s = c.delay_s = 0.3
        served = _ok_nodes(edge, 30, workers=6)
        assert sum(served.values()) == 30 and a.hits > before, served
    finally:
        a.gate.set()
        for t in streams:
            t.join(10)
    assert "circuit breaker of node a closed (probe succeeded)" in edge.error_log()


def test_hanging_node_times_out_and_is_avoided(pool) -> None:
    edge, (a, b, c) = pool(read_timeout_ms=400, breaker_failures=2, breaker_cooldown_s=30.0)
    a.mode = "hang"
    t0 = time.monotonic()
    served = _ok_nodes(edge, 20)
    assert "a" not in served and sum(served.values()) == 20
    assert a.hits == 2, "two timeouts open the breaker"
    assert edge.node_status("a")["breaker"] == "open"
    assert time.monotonic() - t0 < 8
    assert "upstream timed out" in edge.error_log()


def test_local_signals_steer_away_from_a_failing_node(tiny_upstreams, redis_server,
                                                      edge_factory) -> None:
    """Without scores (static list), one failure already costs a node its share; the
    penalty decays (half-life breaker_cooldown_s) so it is not sidelined for good."""
    ups = tiny_upstreams(names=["a", "b", "c"])
    a = ups[0]
    edge = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups],
                                      breaker_failures=50, breaker_cooldown_s=1.0))
    a.mode = "fail"
    served = _ok_nodes(edge, 30)
    assert "a" not in served and sum(served.values()) == 30
    assert 1 <= a.hits <= 3
    fr = edge.node_status("a")["failure_rate"]
    # one failure makes it 0.3 (FAILURE_ALPHA), decaying since (half-life 1 s)
    assert fr >= 0.2
    procs.wait_until(lambda: edge.node_status("a")["failure_rate"] <= fr / 2, 5,
                     what="failure rate halves within a half-life")
    assert edge.node_status("a")["breaker"] == "closed"


def test_busy_node_is_retried_elsewhere(pool) -> None:
    edge, (a, b, c) = pool()
    a.mode = "busy"
    served = _ok_nodes(edge, 20)
    assert "a" not in served and sum(served.values()) == 20
    st = edge.node_status("a")
    assert a.hits >= 1 and st["failures"] == a.hits
    assert st["breaker"] == "closed", "429 means busy, not broken"


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "proxy"])
def test_garbage_node_gets_502s_until_its_breaker_opens(pool, relay: bool) -> None:
    """nginx's proxy path cannot retry a non-HTTP answer (it takes it for HTTP/0.9): that
    attempt becomes a clean 502 JSON; relayed (edge.answer_relay), the request is
    retried on another node. Either way the breaker counts it, and the node is soon
    avoided."""
    edge, (a, b, c) = pool(breaker_failures=2, breaker_cooldown_s=30.0, answer_relay=relay)
    a.mode = "garbage"
    codes = Counter()
    for _ in range(30):
        res = _post(edge)
        codes[res.status_code] += 1
        if res.status_code == 502:
            err = _json_error(res, 502)
            assert err["code"] == "upstream_invalid_answer" and "not HTTP" in err["message"]
        else:
            assert res.status_code == 200 and res.headers["X-Infergate-Node"] in ("b", "c")
    assert codes[502] == (0 if relay else a.hits) and 1 <= a.hits <= 2
    assert codes[200] == 30 - codes[502]
    assert edge.node_status("a")["breaker"] == "open" or a.hits < 2


def test_openai_sdk_rides_over_a_garbage_node(pool) -> None:
    import openai

    edge, (a, b, c) = pool(breaker_failures=1, breaker_cooldown_s=30.0)
    a.mode = "garbage"
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="x", max_retries=2, timeout=10)
    for _ in range(10):
        out = client.chat.completions.create(model="tiny", messages=CHAT["messages"])
        assert out.system_fingerprint in ("b", "c")


def test_garbage_from_the_only_node_is_a_502(tiny_upstreams, redis_server, edge_factory) -> None:
    (a,) = tiny_upstreams(names=["a"])
    a.mode = "garbage"
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()]))
    for stream in (False, True):
        err = _json_error(_post(edge, stream=stream), 502)
        assert err["type"] == "bad_gateway" and err["code"] == "upstream_invalid_answer"
    assert a.hits == 2
    assert edge.node_status("a")["failures"] == 2
    # the access log and the metrics record the 502 the client got, not nginx's HTTP/0.9
    procs.wait_until(lambda: edge.access_log().count('" 502 ') == 2, 5, what="access log")
    assert '" 009 ' not in edge.access_log()
    metrics = requests.get(edge.metrics_url, timeout=5).text
    assert 'status="502"' in metrics and 'status="9"' not in metrics
    # an HTTP/1.0 client gets an HTTP/1.0 answer
    host, port = edge.url.removeprefix("http://").split(":")
    body = b'{"model": "tiny"}'
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.0 502 Bad Gateway\r\n") and b"upstream_invalid_answer" in data


def test_the_only_node_back_is_probed_before_its_cooldown_ends(tiny_upstreams, redis_server,
                                                              edge_factory) -> None:
    """nginx never marks the only server of an upstream down. When every node's breaker
    is open, one probe goes after 1 s instead of 503s for the whole cooldown (30 s here):
    a node restarted in half a second serves again within a few seconds."""
    (a,) = tiny_upstreams(names=["a"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()],
                                      breaker_failures=2, breaker_cooldown_s=30.0))
    a.mode = "garbage"
    for _ in range(2):
        _json_error(_post(edge), 502)
    opened = time.monotonic()
    assert edge.node_status("a")["breaker"] == "open"
    res = _post(edge)
    if time.monotonic() - opened < 0.9:                  # (on a host not too loaded)
        assert _json_error(res, 503)["code"] == "no_healthy_upstream"
        assert res.headers["Retry-After"] == "1"
    a.mode = "ok"
    procs.wait_until(lambda: _post(edge).status_code == 200, 10, interval=0.2,
                     what="the only node served again")
    assert edge.node_status("a")["breaker"] == "closed"
    assert "circuit breaker of node a closed (probe succeeded)" in edge.error_log()


def test_500s_from_the_only_node_never_open_its_breaker(tiny_upstreams, redis_server,
                                                      edge_factory) -> None:
    """A 500 no other node saw is no evidence against its node: a client whose input
    the only node cannot take (llama-server answers 500 to an image part) gets that 500
    as many times as it sends it, plain or streamed, and the node's breaker stays closed,
    so everyone else is still served (as behind nginx, which never takes its only server
    out). A node that fails what another node answers still opens its breaker
    (test_failing_node_is_avoided_breaker_opens_and_recovers)."""
    (a,) = tiny_upstreams(names=["a"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()], breaker_failures=3))
    a.mode = "fail"
    for i in range(8):
        res = _post(edge, stream=i % 2 == 1)
        assert res.status_code == 500 and "simulated failure" in res.text, res.text
    st = edge.node_status("a")
    assert st["breaker"] == "closed" and st["failures"] == 0, st
    a.mode = "ok"
    assert _post(edge).status_code == 200
    assert a.hits == 9


def test_all_nodes_down_gets_a_json_502(pool) -> None:
    edge, ups = pool(max_tries=5)
    for u in ups:
        u.stop()
    for stream in (False, True):
        err = _json_error(_post(edge, stream=stream), 502)
        assert err["code"] == "upstream_error"
        assert "Tried 3 time(s)" in err["message"], "each node once, no more tries than nodes"
    assert all(n["failures"] >= 1 for n in edge.status()["nodes"])


def test_all_nodes_failing_passes_the_last_answer(pool) -> None:
    edge, ups = pool(breaker_failures=100)
    for u in ups:
        u.mode = "fail"
    res = _post(edge)
    assert res.status_code == 500 and res.json()["error"]["message"] == "simulated failure"
    # a 500 goes to a second node, no further; the same 500 on both: neither is counted
    assert sum(u.hits for u in ups) == 2
    assert all(n["failures"] == 0 for n in edge.status()["nodes"])


def test_no_node_left_for_the_retry_gets_503(tiny_upstreams, redis_server, edge_factory) -> None:
    """The first try hangs; meanwhile the only other node turns unhealthy: the retry has
    nowhere to go and the client gets 503 no_healthy_upstream."""
    a, b = tiny_upstreams(names=["a", "b"])
    a.mode = "hang"
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      read_timeout_ms=1500))
    r = redis_server.client()
    snap = write_snapshot(r, [a.snapshot_node(score=0.0), b.snapshot_node(score=0.9)])
    edge.wait_snapshot(snap["version"])
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("res", _post(edge)))
    t.start()
    procs.wait_until(lambda: a.hits == 1, 5, what="first try on a")
    snap = write_snapshot(r, [a.snapshot_node(score=0.0), b.snapshot_node(healthy=False)])
    edge.wait_snapshot(snap["version"])
    t.join(10)
    err = _json_error(result["res"], 503)
    assert err["code"] == "no_healthy_upstream" and err["type"] == "service_unavailable"
    assert result["res"].headers["Retry-After"] == "1"  # admission.retry_after_s
    assert b.hits == 0


def test_client_abort_releases_in_flight(tiny_upstreams, redis_server, edge_factory) -> None:
    a, = tiny_upstreams(names=["a"])
    a.gate = threading.Event()
    a.chunks = 3
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()]))
    host, port = edge.url.removeprefix("http://").split(":")
    body = b'{"model": "tiny", "stream": true}'
    # a stream the client leaves after the first chunk
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert b"200 OK" in s.recv(65536)
    procs.wait_until(lambda: edge.node_status("a")["inflight"] == 1, 5, what="stream in flight")
    s.close()
    procs.wait_until(lambda: edge.node_status("a")["inflight"] == 0, 10, what="released after abort")
    # a non-streaming request on a node that never answers, abandoned by the client
    a.mode = "hang"
    with pytest.raises(requests.exceptions.ReadTimeout):
        _post(edge, timeout=0.5)
    procs.wait_until(lambda: a.hits == 2, 5)
    procs.wait_until(lambda: edge.node_status("a")["inflight"] == 0, 10, what="released after abort")
    st = edge.node_status("a")
    assert st["breaker"] == "closed" and st["failures"] == 0, "a client leaving is not the node's fault"
    a.gate.set()


def test_a_kept_alive_connection_the_node_closed_is_retried_on_the_same_node(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A node that drops an idle connection as the edge reuses it (llama.cpp's server does
    after a stream): nginx retries such a request once for free, and with one node the
    retry goes to the same node on a new connection, as plain nginx does, instead of a 503;
    the dropped connection is no fault of the node's."""
    (a,) = tiny_upstreams(names=["a"])
    a.mode = "close_reused"
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()], workers=1))
    for _ in range(6):
        res = _post(edge)
        assert res.status_code == 200, res.text
    # every request after the first met a kept-alive connection the node then closed
    assert a.hits > 6
    assert edge.node_status("a")["failures"] == 0
