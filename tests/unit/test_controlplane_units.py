"""Pure pieces of the control plane: poll classification, per-node tracking, slow
start, edge stats, drain decisions, host resolution; and the HTTP poller against
small local servers (a mute socket, an OpenAI-compatible server without /health)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.config import NodeSettings, settings_from_dict
from controlplane.routing.poller import (HttpResult, NodeTracker, Poller, PollResult, breakers_open,
                                         classify)
from controlplane.routing.registry import NodeState
from controlplane.routing.snapshot import (
    HostResolver, build_snapshot, drain_decisions, effective_weight, fresh_inflight,
)

VLLM_BODY = ('vllm:num_requests_waiting{engine="0",model_name="m"} 4\n'
             'vllm:num_requests_running{engine="0",model_name="m"} 2\n'
             'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
             'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} %d\n'
             'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} %f\n')
OK_HEALTH = HttpResult(status=200, body="", elapsed_ms=2.0)


def metrics(body: str, status: int = 200) -> HttpResult:
    return HttpResult(status=status, body=body, content_type="text/plain", elapsed_ms=3.0)


# -- classify ---------------------------------------------------------------------------


def test_classify_good_poll_with_metrics():
    p = classify(OK_HEALTH, metrics(VLLM_BODY % (1, 1.0)))
    assert p.good and p.reachable and p.reading is not None and p.error is None
    assert p.poll_ms == 3.0


def test_classify_metrics_5xx_is_good_without_metrics():
    p = classify(OK_HEALTH, metrics("oops", status=500))
    assert p.good and p.reading is None and p.error == "metrics: HTTP 500"


def test_classify_unparseable_metrics_fails_the_poll():
    p = classify(OK_HEALTH, metrics("<html>502 Bad Gateway</html>"))
    assert not p.good and p.reachable and "unparseable" in p.error


def test_classify_unknown_names_is_good_without_metrics():
    p = classify(OK_HEALTH, metrics("process_cpu_seconds_total 3\n"))
    assert p.good and p.reading is None and "no vllm:" in p.error


@pytest.mark.parametrize("health,reachable", [
    (HttpResult(status=503), True),
    (HttpResult(error="connection refused"), False),
    (HttpResult(error="timeout after 0.5 s"), False),
])
def test_classify_bad_health_fails(health, reachable):
    p = classify(health, None)
    assert not p.good and p.reachable is reachable and p.error.startswith("health: ")


# -- NodeTracker ------------------------------------------------------------------------


def settings(**cp):
    base = {"poll_interval_s": 1.0, "unhealthy_after": 2, "healthy_after": 1}
    base.update(cp)
    return settings_from_dict({"controlplane": base})


def poll(body: str | None, good: bool = True) -> PollResult:
    from controlplane.routing.nodemetrics import parse_metrics
    return PollResult(good=good, reachable=good,
                      reading=parse_metrics(body) if body else None, poll_ms=1.0)


def test_tracker_scores_and_windows():
    t = NodeTracker(NodeSettings(name="a", url="http://10.0.0.1:8000", weight=2.0), settings())
    st, changed = t.update(poll(VLLM_BODY % (10, 10.0)), now=100.0)
    assert not changed and st.healthy and st.has_metrics and st.dialect == "vllm"
    assert (st.queue_depth, st.running, st.kv_cache_usage, st.e2e_avg_s) == (4, 2, 0.5, None)
    # q = 0.25, kv = 0.5 -> (0.5*0.25 + 0.3*0.5) / 0.8 / weight 2
    assert st.score == pytest.approx((0.125 + 0.15) / 0.8 / 2)
    st, _ = t.update(poll(VLLM_BODY % (12, 16.0)), now=101.0)
    assert st.e2e_avg_s == pytest.approx(3.0)
    # Metrics missing for a poll: the metrics doc says unknown, the score holds.
    held = st.score
    st, _ = t.update(poll(None), now=102.0)
    assert st.queue_depth is None and not st.has_metrics and st.score == held
    # The window after the gap spans it: (12 -> 13 requests, 16 -> 17.5 s).
    st, _ = t.update(poll(VLLM_BODY % (13, 17.5)), now=103.0)
    assert st.e2e_avg_s == pytest.approx(1.5)


def test_tracker_metrics_gone_for_long_drops_score():
    t = NodeTracker(NodeSettings(name="a", url="http://10.0.0.1:8000"), settings())
    t.update(poll(VLLM_BODY % (1, 1.0)), now=100.0)
    st, _ = t.update(poll(None), now=100.0 + 5 * 1.0 + 0.1)  # HOLD_POLLS x interval
    assert st.score is None


def test_tracker_health_changes_and_openai_has_no_score():
    t = NodeTracker(NodeSettings(name="o", url="http://10.0.0.1:11434", kind="openai"), settings())
    assert t.update(poll(None, good=False), 1.0)[1] is False
    st, changed = t.update(poll(None, good=False), 2.0)
    assert changed and not st.healthy and st.consecutive_failures == 2
    st, changed = t.update(poll(None), 3.0)
    assert changed and st.healthy and st.score is None


def test_tracker_same_target():
    n = NodeSettings(name="a", url="http://10.0.0.1:8000")
    t = NodeTracker(n, settings())
    assert t.same_target(n.model_copy(update={"weight": 5.0}))
    assert not t.same_target(n.model_copy(update={"url": "http://10.0.0.2:8000"}))
    assert not t.same_target(n.model_copy(update={"kind": "tgi"}))


# -- snapshot pieces --------------------------------------------------------------------


def test_effective_weight_ramp():
    active = NodeState("active", since=1000.0)
    assert effective_weight(2.0, active, now=1000.0, slow_start_s=30) == pytest.approx(0.2)
    assert effective_weight(2.0, active, now=1015.0, slow_start_s=30) == pytest.approx(1.0)
    assert effective_weight(2.0, active, now=1030.0, slow_start_s=30) == 2.0
    assert effective_weight(2.0, active, now=990.0, slow_start_s=30) == pytest.approx(0.2)
    assert effective_weight(2.0, NodeState(), now=5.0, slow_start_s=30) == 2.0
    assert effective_weight(2.0, active, now=1001.0, slow_start_s=0) == 2.0
    assert effective_weight(2.0, NodeState("draining", 1000.0), 1001.0, 30) == 2.0


def test_fresh_inflight_sums_fresh_edges_and_skips_bad_ones():
    now = 1000.0
    raw = {
        "e1": json.dumps({"ts": now - 1, "nodes": {"a": {"inflight": 2}, "b": {"inflight": 1}}}),
        "e2": json.dumps({"ts": now - 5, "nodes": {"a": {"inflight": 3}}}),
        "old": json.dumps({"ts": now - 100, "nodes": {"a": {"inflight": 50}}}),
        "junk": "not json",
        "no-ts": json.dumps({"nodes": {"a": {"inflight": 7}}}),
        "bad-nodes": json.dumps({"ts": now, "nodes": [1, 2]}),
        "bad-count": json.dumps({"ts": now, "nodes": {"a": {"inflight": "many"}, "c": 4}}),
    }
    assert fresh_inflight(raw, now, max_age_s=30) == {"a": 5.0, "b": 1.0}


def test_drain_decisions():
    now = 1000.0
    states = {"idle": NodeState("draining", 990.0), "busy": NodeState("draining", 990.0),
              "running": NodeState("draining", 990.0), "fresh": NodeState("draining", 999.95),
              "old": NodeState("draining", 300.0), "active": NodeState("active", 990.0),
              "unknown": NodeState("draining", 990.0)}
    running = {"idle": 0.0, "busy": 0.0, "running": 2.0, "fresh": 0.0, "old": 9.0,
               "active": 0.0, "unknown": None}
    inflight = {"busy": 1.0, "old": 4.0}
    got = drain_decisions(states, running, inflight, now, drain_timeout_s=600, grace_s=0.1)
    assert [(d.name, d.reason) for d in got] == [("idle", "idle"), ("old", "timeout"),
                                                 ("unknown", "idle")]
    assert got[0].since == 990.0


def test_build_snapshot_defaults_before_first_poll():
    n = NodeSettings(name="a", url="http://10.0.0.1", max_concurrency=8)
    snap = build_snapshot(version=7, now=5.0, leader="x", nodes=[n], states={}, statuses={},
                          hosts={"a": "10.0.0.1"}, slow_start_s=30)
    (e,) = snap.nodes
    assert snap.version == 7 and snap.leader == "x"
    assert e.port == 80 and e.healthy is True and e.state == "active"
    assert e.score is None and e.has_metrics is False and e.max_concurrency == 8
    assert json.loads(snap.to_json())["nodes"][0]["port"] == 80


def test_host_resolver_caches_and_keeps_last_good():
    answers: list[list[str] | Exception] = [["10.1.1.1"], OSError("dns down"), ["10.2.2.2"]]
    calls = []

    def lookup(host: str) -> list[str]:
        calls.append(host)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    h = HostResolver(ttl_s=10, negative_ttl_s=2, lookup=lookup)
    assert h.resolve("node.example", 0.0) == "10.1.1.1"
    assert h.resolve("node.example", 5.0) == "10.1.1.1" and len(calls) == 1
    assert h.resolve("node.example", 11.0) == "10.1.1.1"  # lookup failed: keep last good
    assert h.resolve("node.example", 12.0) == "10.1.1.1" and len(calls) == 2
    assert h.resolve("node.example", 13.5) == "10.2.2.2"
    assert h.resolve("10.9.9.9", 0.0) == "10.9.9.9" and h.resolve("[::1]", 0.0) == "::1"
    assert HostResolver(lookup=lambda _h: []).resolve("nowhere.invalid", 0.0) is None


# -- the HTTP poller against real local servers -----------------------------------------


@pytest.fixture
def mute_port():
    """A listening socket that never answers (connect succeeds, no response)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


def test_poller_times_out_on_a_mute_server(mute_port):
    p = Poller(timeout_s=0.3)
    try:
        t0 = time.monotonic()
        res = p.poll_all([NodeSettings(name="m", url=f"http://127.0.0.1:{mute_port}")])["m"]
        assert time.monotonic() - t0 < 1.5
        assert not res.good and not res.reachable and "no answer" in res.error
        assert res.busy
    finally:
        p.close()


def test_a_busy_poll_is_good_only_while_the_node_has_work():
    node = NodeSettings(name="b", url="http://127.0.0.1:9", kind="openai")
    t = NodeTracker(node, settings())
    busy = PollResult(good=False, reachable=False, error="health: busy", busy=True)
    for i in range(5):
        st, _ = t.update(busy, float(i), inflight=1.0)
        assert st.healthy, "a node generating for the edges is busy, not down"
    for i in range(3):
        st, _ = t.update(busy, 10.0 + i, inflight=0.0)
    assert not st.healthy, "connected but mute with nothing to do: down"
    dead = PollResult(good=False, reachable=False, error="health: connection refused")
    t2 = NodeTracker(node, settings())
    for i in range(3):
        st, _ = t2.update(dead, float(i), inflight=5.0)
    assert not st.healthy, "refused connections are never busy"


def test_a_busy_poll_trusts_the_nodes_own_running_count_only_while_it_is_recent():
    """A server whose last metrics page showed requests running and that then stops
    answering (frozen): its busy polls are good for a few polls, not for ever (before,
    the page read before the freeze kept it healthy as long as it stayed frozen)."""
    from controlplane.routing.nodemetrics.model import Reading

    t = NodeTracker(NodeSettings(name="v", url="http://127.0.0.1:9"), settings())
    page = PollResult(good=True, reachable=True,
                      reading=Reading(dialect="vllm", queue_depth=0.0, running=3.0))
    st, _ = t.update(page, 0.0)
    assert st.healthy
    busy = PollResult(good=False, reachable=False, error="health: busy", busy=True)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        st, _ = t.update(busy, now)
        assert st.healthy and st.consecutive_failures == 0, now
    for now in (6.0, 7.0, 8.0):
        st, _ = t.update(busy, now)
    assert not st.healthy, "no page for longer than the hold: its old count is no evidence"


def test_breakers_open_needs_every_fresh_edge():
    def rep(ts, **breakers):
        return json.dumps({"ts": ts, "nodes": {n: {"breaker": b, "inflight": 0}
                                               for n, b in breakers.items()}})
    edges = {"e1": rep(100.0, a="open", b="open", c="closed"),
             "e2": rep(99.0, a="open", b="half_open"),
             "old": rep(10.0, a="closed", c="open"),
             "junk": "{not json"}
    assert breakers_open(edges, 100.0, max_age_s=20.0) == {"a"}


def test_an_openai_node_tripped_at_every_edge_is_unhealthy():
    ok = PollResult(good=True, reachable=True)
    t = NodeTracker(NodeSettings(name="o", url="http://127.0.0.1:9", kind="openai"), settings())
    for i in range(3):
        st, _ = t.update(ok, float(i), edges_open=True)
    assert not st.healthy and "circuit breaker open at every edge" in st.last_error
    for i in range(2):
        st, _ = t.update(ok, 10.0 + i, edges_open=False)
    assert st.healthy
    v = NodeTracker(NodeSettings(name="v", url="http://127.0.0.1:9", kind="vllm"), settings())
    for i in range(3):
        st, _ = v.update(ok, float(i), edges_open=True)
    assert st.healthy, "a node with a health endpoint is judged by it"


class _OpenAIish(BaseHTTPRequestHandler):
    """Answers /v1/models only, like Ollama (no /health); records the paths asked."""

    paths: list[str] = []

    def do_GET(self):  # noqa: N802
        self.paths.append(self.path)
        if self.path == "/v1/models":
            body = b'{"object":"list","data":[]}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404 if self.path != "/loading" else 503)

    def log_message(self, *args):
        pass


@pytest.fixture
def openai_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIish)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    th.join(timeout=5)


def test_openai_node_without_health_endpoint_is_alive_and_models_never_polled(openai_server):
    url = f"http://127.0.0.1:{openai_server}"
    _OpenAIish.paths.clear()
    p = Poller(timeout_s=1.0)
    try:
        res = p.poll_all([
            NodeSettings(name="o", url=url, kind="openai"),
            NodeSettings(name="loading", url=url, kind="openai", health_path="/loading"),
            NodeSettings(name="v", url=url, kind="vllm"),
        ])
        # the 404 of /health proves the server is up; /v1/models (which may wait on the
        # model, llama-cpp-python) is never called
        assert res["o"].good and res["o"].reading is None
        assert "liveness only" in res["o"].error
        assert "/v1/models" not in _OpenAIish.paths
        assert not res["loading"].good and "HTTP 503" in res["loading"].error
        # A metrics kind gets no fallback: its health path is the contract.
        assert not res["v"].good and "health: HTTP 404" in res["v"].error
    finally:
        p.close()


@pytest.fixture
def trickle_port():
    """A server that answers 200 and then sends one byte every 50 ms, never finishing."""
    stop = threading.Event()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    conns: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for c in conns:
            c.close()

    def drip() -> None:
        while not stop.wait(0.05):
            for c in list(conns):
                try:
                    c.sendall(b"x")
                except OSError:
                    pass

    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=drip, daemon=True)]
    for t in threads:
        t.start()
    yield srv.getsockname()[1]
    stop.set()
    for t in threads:
        t.join(timeout=5)
    srv.close()


def test_a_node_still_being_polled_is_not_polled_again(trickle_port):
    # A server trickling bytes keeps its poll thread busy past the deadline; the next
    # cycles must not pile more threads onto it (or every node would end up "late").
    node = NodeSettings(name="t", url=f"http://127.0.0.1:{trickle_port}", kind="openai")
    p = Poller(timeout_s=0.3, max_workers=4)
    try:
        first = p.poll_all([node])["t"]
        assert not first.good
        for _ in range(5):
            res = p.poll_all([node])["t"]
            assert not res.good and "still running" in res.error
        assert len(p._running["t"]) == 1                    # still only the first poll
    finally:
        p.close()
