"""The edge routing on snapshots written straight into Redis (deterministic, no control
plane): score-driven shares, stale snapshots, unhealthy and draining nodes, Redis
going away and coming back, bad snapshots, and the per-edge stats it publishes."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from support.stack import edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _post(edge, **kw) -> requests.Response:
    return requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, **kw}, timeout=15)


def _shares(edge, n: int, workers: int = 4) -> Counter:
    def one(_: int) -> str:
        res = _post(edge)
        assert res.status_code == 200, res.text
        return res.headers["X-Infergate-Node"]

    with ThreadPoolExecutor(workers) as pool:
        return Counter(pool.map(one, range(n)))


@pytest.fixture
def three(tiny_upstreams, redis_server, edge_factory):
    ups = tiny_upstreams(names=["a", "b", "c"])
    for u in ups:
        u.delay_s = 0.01
    edge = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups],
                                      stale_after_s=3.0))
    return edge, ups, redis_server.client()


def test_busy_node_gets_a_clearly_smaller_share(three) -> None:
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(score=0.9, queue_depth=14),
                              b.snapshot_node(score=0.05), c.snapshot_node(score=0.05)])
    edge.wait_snapshot(snap["version"])
    shares = _shares(edge, 90)
    assert shares["a"] <= 5, shares          # P2C never prefers it over an idle node
    assert shares["b"] >= 30 and shares["c"] >= 30, shares


def test_stale_snapshot_still_serves_on_local_signals(three) -> None:
    """Scores of a stale snapshot are ignored: the 'busy' node gets a fair share again."""
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(score=0.9), b.snapshot_node(score=0.05),
                              c.snapshot_node(score=0.05)], generated_at=time.time() - 60)
    st = edge.wait_snapshot(snap["version"])
    assert st["snapshot"]["stale"] is True and st["snapshot"]["age_s"] > 50
    shares = _shares(edge, 90)
    assert shares["a"] >= 15, shares
    assert sum(shares.values()) == 90


def test_unhealthy_and_unroutable_nodes_are_skipped(three) -> None:
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(healthy=False), b.snapshot_node(state="drained"),
                              c.snapshot_node(), {**c.snapshot_node(), "name": "named-host", "host": "gpu.local"},
                              {**c.snapshot_node(), "name": "no-host", "host": None}])
    st = edge.wait_snapshot(snap["version"])
    eligible = {n["name"]: n["eligible"] for n in st["nodes"]}
    assert eligible == {"a": False, "b": False, "c": True, "named-host": False, "no-host": False}
    assert set(_shares(edge, 20)) == {"c"}
    assert a.hits == 0 and b.hits == 0


def test_all_unhealthy_gets_503_without_any_upstream_attempt(three) -> None:
    edge, ups, r = three
    snap = write_snapshot(r, [u.snapshot_node(healthy=False) for u in ups])
    edge.wait_snapshot(snap["version"])
    for stream in (False, True):
        res = _post(edge, stream=stream)
        assert res.status_code == 503
        assert res.headers["Content-Type"] == "application/json"
        assert res.json()["error"]["code"] == "no_healthy_upstream"
        assert res.json()["error"]["type"] == "service_unavailable"
    assert sum(u.hits for u in ups) == 0
    assert "X-Infergate-Node" not in res.headers
    assert all(n["requests"] == 0 for n in edge.status()["nodes"])


def test_a_frozen_pool_holds_requests_until_a_node_is_back(three) -> None:
    """Every node unhealthy and silent (its polls connected, no answer: frozen) holds a
    request within its deadline, as nginx's proxy waits on frozen nodes, and it is
    served once a node is healthy again; when the last silent node turns refused
    instead, the held request gets its 503 at once."""
    edge, ups, r = three
    snap = write_snapshot(r, [{**u.snapshot_node(healthy=False), "connects": True} for u in ups])
    edge.wait_snapshot(snap["version"])
    t0 = time.monotonic()             # the model list is not held: no slot to wait for
    assert requests.get(f"{edge.url}/v1/models", timeout=5).status_code == 503
    assert time.monotonic() - t0 < 1
    with ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        held = pool.submit(_post, edge, stream=False)
        held_stream = pool.submit(_post, edge, stream=True)
        procs.wait_until(lambda: edge.status()["admission"]["held"] == 2, 10,
                         what="both requests held")
        assert not held.done() and sum(u.hits for u in ups) == 0
        snap = write_snapshot(r, [ups[0].snapshot_node()] + [
            {**u.snapshot_node(healthy=False), "connects": True} for u in ups[1:]])
        for f in (held, held_stream):
            res = f.result(timeout=15)
            assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "a", res.text
        assert time.monotonic() - t0 < 10
        assert edge.status()["admission"]["held"] == 0
        snap = write_snapshot(r, [{**u.snapshot_node(healthy=False), "connects": True} for u in ups])
        edge.wait_snapshot(snap["version"])
        held = pool.submit(_post, edge)
        procs.wait_until(lambda: edge.status()["admission"]["held"] == 1, 10,
                         what="the request held")
        snap = write_snapshot(r, [u.snapshot_node(healthy=False) for u in ups])   # refused now
        t1 = time.monotonic()
        res = held.result(timeout=15)
        assert res.status_code == 503 and res.json()["error"]["code"] == "no_healthy_upstream"
        assert time.monotonic() - t1 < 5
    # at most as many held as those nodes have slots (1 each here): the rest get the 503
    # at once
    snap = write_snapshot(r, [{**u.snapshot_node(healthy=False, max_concurrency=1),
                               "connects": True} for u in ups])
    edge.wait_snapshot(snap["version"])
    with ThreadPoolExecutor(5) as pool:
        futs = [pool.submit(_post, edge) for _ in range(5)]
        procs.wait_until(lambda: sum(f.done() for f in futs) == 2, 10, what="two 503s at once")
        assert all(f.result().status_code == 503 for f in futs if f.done())
        assert edge.status()["admission"]["held"] == 3
        write_snapshot(r, [u.snapshot_node(max_concurrency=1) for u in ups])
        assert sorted(f.result(timeout=15).status_code for f in futs) == [200] * 3 + [503] * 2
    # a client that leaves while held ends its request (499), no node is asked
    snap = write_snapshot(r, [{**u.snapshot_node(healthy=False), "connects": True} for u in ups])
    edge.wait_snapshot(snap["version"])
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=0.5)
    procs.wait_until(lambda: re.search(r'" 499 ', edge.access_log()), 10,
                     what="the held request ended when its client left")
    assert edge.status()["admission"]["held"] == 0
    assert sum(u.hits for u in ups) == 5


def test_a_request_waiting_for_a_slot_is_held_when_the_pool_freezes(three) -> None:
    """A request already waiting at the edge for a slot when every node of its model
    turns unhealthy but still connects (frozen) is held for them like a new arrival,
    and served once a node is back; not sent on to the 503 at once."""
    edge, ups, r = three
    for u in ups:
        u.delay_s = 1.5
    snap = write_snapshot(r, [u.snapshot_node(slots=1) for u in ups])
    edge.wait_snapshot(snap["version"])
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(_post, edge) for _ in range(3)]
        procs.wait_until(lambda: sum(u.inflight for u in ups) == 3, 10,
                         what="every slot taken")
        waiting = pool.submit(_post, edge)
        procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 1, 10,
                         what="a request waiting for a slot")
        snap = write_snapshot(r, [{**u.snapshot_node(healthy=False, slots=1), "connects": True}
                                  for u in ups])
        edge.wait_snapshot(snap["version"])
        procs.wait_until(lambda: edge.status()["admission"]["held"] == 1, 10,
                         what="the waiting request held")
        assert [f.result(timeout=15).status_code for f in busy] == [200] * 3
        time.sleep(0.5)
        assert not waiting.done()
        write_snapshot(r, [u.snapshot_node(slots=1) for u in ups])
        res = waiting.result(timeout=15)
        assert res.status_code == 200, res.text
    assert edge.status()["admission"]["held"] == 0
    assert edge.status()["admission"]["waiting"] == 0


def test_draining_node_gets_nothing_new_while_its_stream_finishes(three) -> None:
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(), b.snapshot_node(healthy=False),
                              c.snapshot_node(healthy=False)])
    edge.wait_snapshot(snap["version"])
    a.gate = threading.Event()
    a.chunks = 4
    result: dict = {}

    def stream() -> None:
        with requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                           stream=True, timeout=30) as res:
            result["node"] = res.headers.get("X-Infergate-Node")
            result["body"] = b"".join(res.iter_content(chunk_size=None)).decode()

    t = threading.Thread(target=stream)
    t.start()
    procs.wait_until(lambda: edge.node_status("a")["inflight"] == 1, 10, what="stream on a")
    snap = write_snapshot(r, [a.snapshot_node(state="draining"), b.snapshot_node(),
                              c.snapshot_node()])
    edge.wait_snapshot(snap["version"])
    before = a.hits
    shares = _shares(edge, 30)
    assert "a" not in shares and a.hits == before
    assert edge.node_status("a")["inflight"] == 1
    a.gate.set()
    t.join(15)
    assert result["node"] == "a"
    events = [x for x in result["body"].splitlines() if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 5
    assert [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]] == \
        ["tok0 ", "tok1 ", "tok2 ", "tok3 "]
    procs.wait_until(lambda: edge.node_status("a")["inflight"] == 0, 10, what="a idle")


def test_redis_outage_keeps_the_last_snapshot(three, redis_server, workdir) -> None:
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(healthy=False), b.snapshot_node(),
                              c.snapshot_node(healthy=False)])
    edge.wait_snapshot(snap["version"])
    # Redis goes away: the edge keeps routing on that snapshot (only b), not on its
    # static list (a, b, c), and never answers an error
    redis_server.stop()
    procs.wait_until(lambda: edge.status()["snapshot"]["redis_ok"] is False, 10, what="outage seen")
    fetched = edge.status()["snapshot"]["fetched_at"]
    assert set(_shares(edge, 20)) == {"b"}
    st = edge.status()
    assert st["snapshot"]["source"] == "redis" and st["snapshot"]["version"] == snap["version"]
    assert st["snapshot"]["fetched_at"] == fetched
    assert edge.error_log().count("Redis unreachable") == 1  # once per outage, not per sync
    # Redis returns: a new snapshot is picked up and the recovery logged
    redis_server.start_again(workdir / "redis")
    snap2 = write_snapshot(redis_server.client(), [a.snapshot_node(), b.snapshot_node(healthy=False),
                                                   c.snapshot_node(healthy=False)],
                           version=snap["version"] + 1)
    edge.wait_snapshot(snap2["version"])
    assert set(_shares(edge, 10)) == {"a"}
    assert edge.error_log().count("Redis unreachable") == 1
    assert "Redis reachable again" in edge.error_log()
    assert edge.status()["snapshot"]["redis_ok"] is True


def test_stale_snapshot_after_outage_still_serves(three, redis_server) -> None:
    """Redis gone for longer than stale_after_s: the old snapshot turns stale, the
    edge still routes on its node list and states."""
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(healthy=False), b.snapshot_node(score=0.9),
                              c.snapshot_node(score=0.1)], generated_at=time.time() - 2.5)
    edge.wait_snapshot(snap["version"])
    redis_server.stop()
    procs.wait_until(lambda: edge.status()["snapshot"]["stale"] is True, 10, what="snapshot stale")
    shares = _shares(edge, 40)
    assert set(shares) <= {"b", "c"} and sum(shares.values()) == 40
    assert shares["b"] >= 8, shares  # its high score no longer counts


def test_bad_snapshots_are_ignored(three) -> None:
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(), b.snapshot_node(healthy=False),
                              c.snapshot_node(healthy=False)])
    edge.wait_snapshot(snap["version"])
    r.set(keynames.ROUTING, "{not json")
    procs.wait_until(lambda: "ignoring routing snapshot" in edge.error_log(), 10, what="bad snapshot log")
    r.set(keynames.ROUTING, json.dumps({"version": 99, "nodes": "nope"}))
    procs.wait_until(lambda: edge.error_log().count("ignoring routing snapshot") == 2, 10,
                     what="second bad snapshot log")
    st = edge.status()
    assert st["snapshot"]["version"] == snap["version"]
    assert set(_shares(edge, 10)) == {"a"}
    # invalid entries inside a good snapshot are skipped, the rest is used
    snap2 = write_snapshot(r, [b.snapshot_node(), {"name": "broken", "port": "x"}, {"port": 1}])
    st = edge.wait_snapshot(snap2["version"])
    assert [n["name"] for n in st["nodes"]] == ["b"]
    assert set(_shares(edge, 5)) == {"b"}


def test_edge_publishes_its_stats(three) -> None:
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(), b.snapshot_node(), c.snapshot_node(healthy=False)])
    edge.wait_snapshot(snap["version"])
    shares = _shares(edge, 12)
    edge_id = edge.rendered.edge_id

    def published() -> dict:
        raw = r.hget(keynames.EDGES, edge_id)
        data = json.loads(raw) if raw else {}
        nodes = data.get("nodes", {})
        if (sum(n.get("requests", 0) for n in nodes.values()) == 12
                and all(n.get("inflight") == 0 for n in nodes.values())):
            return data
        return {}

    procs.wait_until(lambda: bool(published()), 10, what="edge stats in Redis")
    data = published()
    assert data["edge_id"] == edge_id and abs(data["ts"] - time.time()) < 5
    # the request-duration histogram of the edge (the admin overview's p50 / p99)
    dur = data["duration"]
    assert len(dur["counts"]) == len(dur["le"]) + 1 and sum(dur["counts"]) >= 12
    assert dur["sum"] > 0
    assert set(data["nodes"]) == {"a", "b", "c"}
    for name, n in data["nodes"].items():
        assert set(n) == {"inflight", "requests", "failures", "breaker", "latency_ewma_ms",
                          "stalled", "silent_s"}
        assert n["stalled"] is False
        assert n["inflight"] == 0 and n["failures"] == 0 and n["breaker"] == "closed"
        assert n["requests"] == shares.get(name, 0)
        if n["requests"]:
            assert n["latency_ewma_ms"] > 0
        else:
            assert n["latency_ewma_ms"] is None


def test_effective_weight_shapes_the_shares(three) -> None:
    """Sampling follows effective_weight (slow start after undrain, weights): a node
    at 0.1 is rarely even a candidate."""
    edge, (a, b, c), r = three
    snap = write_snapshot(r, [a.snapshot_node(effective_weight=0.1, score=None),
                              b.snapshot_node(score=None), c.snapshot_node(score=None)])
    edge.wait_snapshot(snap["version"])
    shares = _shares(edge, 60, workers=1)
    assert shares["a"] <= 12 and shares["b"] >= 18 and shares["c"] >= 18, shares


def test_every_worker_routes_on_the_snapshot(tiny_upstreams, redis_server, edge_factory) -> None:
    """Worker 0 alone talks to Redis; the other workers follow through the shared dict."""
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      workers=2))
    snap = write_snapshot(redis_server.client(), [a.snapshot_node(healthy=False), b.snapshot_node()])
    seen: dict[int, int] = {}

    def both_workers_on_snapshot() -> bool:
        # a new connection each time, so both workers answer sooner or later
        st = requests.get(f"{edge.url}/infergate/status", headers={"Connection": "close"},
                          timeout=5).json()
        seen[st["worker_pid"]] = st["snapshot"]["version"]
        return len(seen) == 2 and all(v == snap["version"] for v in seen.values())

    procs.wait_until(both_workers_on_snapshot, 15, what="both workers on the snapshot")
    for _ in range(20):
        res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT,
                            headers={"Connection": "close"}, timeout=10)
        assert res.headers["X-Infergate-Node"] == "b"
    assert a.hits == 0


def test_a_dead_workers_in_flight_attempts_are_given_back(tiny_upstreams, redis_server,
                                                          edge_factory) -> None:
    """Workers killed with requests in flight never run their log phase; the counts they
    left in the shared dict are given back once they are gone (reconciliation by the sync
    timer of the workers nginx starts in their place), so the node does not look busy
    for good (a drain would never finish, a one-at-a-time node would stay full)."""
    (a,) = tiny_upstreams(names=["a"])
    a.mode = "hang"
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()], workers=2),
                        check_log=False)  # the killed workers' [alert] lines are expected
    write_snapshot(redis_server.client(), [a.snapshot_node()])
    results: list[int] = []   # -1: the killed worker's clients lose their connection
    threads = [edge.post_in_background(CHAT, results) for _ in range(8)]
    procs.wait_until(lambda: a.inflight == 8, 15, what="8 requests held by the node")
    assert edge.status()["inflight_total"] == 8
    assert len(edge.workers()) == 2
    edge.kill_workers()   # both: whichever holds the requests
    a.release()
    for t in threads:
        t.join(30)
    assert len(results) == 8
    procs.wait_until(lambda: edge.status()["inflight_total"] == 0, 15, interval=0.2,
                     what="the dead worker's in-flight attempts given back")
    assert "given back" in edge.error_log()
