"""Writes to Redis off the request path (lua/infergate/core/flush.lua) against a real
nginx: cache stores and counters leave through one recurring timer per worker (no timer
per request), the cache statistics in Redis equal the edge's Prometheus counters, a
full queue drops with a counted metric and no error-log storm, and coalescing waiters go
to a node the moment their leader ends without a storable answer."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from controlplane import procs
from controlplane.config import settings_from_dict
from controlplane.redisdb import keynames
from support.stack import edge_settings
from support.upstack import children

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def cache_edge(redis_server, ups, edge_factory, cache: dict | None = None, **edge: Any):
    s = edge_settings(redis_server.url, [u.node_settings() for u in ups], **edge)
    c = {"enabled": True, "semantic": False}
    c.update(cache or {})
    return edge_factory(settings_from_dict({**s.model_dump(mode="json"), "cache": c}))


def chat(edge, content: str, headers: dict | None = None, timeout: float = 30) -> requests.Response:
    return requests.post(edge.url + CHAT, timeout=timeout, headers=headers or {},
                         json={"model": "m", "temperature": 0,
                               "messages": [{"role": "user", "content": content}]})


def prom_cache(edge) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in requests.get(edge.metrics_url, timeout=5).text.splitlines():
        if line.startswith("infergate_edge_cache_requests_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = float(line.rsplit(" ", 1)[1])
    return out


def prom_value(edge, sample: str) -> float:
    for line in requests.get(edge.metrics_url, timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_cache_statistics_equal_the_prometheus_counters(redis_server, tiny_upstreams,
                                                        edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = cache_edge(redis_server, [up], edge_factory, workers=2)
    r = redis_server.client()
    results: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        for j in range(15):
            res = chat(edge, f"flush counters {j % 5}",
                       {"Cache-Control": "no-store"} if j % 7 == 6 else None)
            with lock:
                results.append(res.headers.get("X-Cache-Status", ""))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 120 and "HIT" in results

    def equal() -> bool:
        p = prom_cache(edge)
        st = {k: int(v) for k, v in r.hgetall(keynames.CACHE_STATS).items()}
        return (st.get("hits_exact", 0) == p.get("hit_exact", 0)
                and st.get("misses", 0) == p.get("miss", 0)
                and st.get("bypass", 0) == p.get("bypass", 0)
                and st.get("lookups", 0) == p.get("hit_exact", 0) + p.get("miss", 0)
                and sum(p.values()) == 120)

    procs.wait_until(equal, 10, what="Redis cache statistics equal to the Prometheus counters")
    st = {k: int(v) for k, v in r.hgetall(keynames.CACHE_STATS).items()}
    assert st["stores"] >= 5
    assert r.ttl(keynames.CACHE_STATS) > 0
    log = edge.error_log()
    assert "lua_max_running_timers" not in log and "lua_max_pending_timers" not in log
    assert "cache store failed" not in log


def test_full_queue_drops_with_a_counted_metric(redis_server, tiny_upstreams, edge_factory) -> None:
    # one write may wait, and the timer runs only every 3 s: the next stores are dropped
    (up,) = tiny_upstreams(1)
    edge = cache_edge(redis_server, [up], edge_factory, flush_queue_max=1,
                      flush_interval_ms=3000)
    r = redis_server.client()
    time.sleep(0.2)
    for i in range(6):
        assert chat(edge, f"flush drop {i}").status_code == 200
    dropped = prom_value(edge, 'infergate_edge_flush_dropped_total{kind="cache_store"}')
    assert dropped >= 4
    # the dropped requests released their coalescing lock: an identical request goes
    # to the node at once instead of waiting coalesce_wait_s for a store that never comes
    t0 = time.monotonic()
    assert chat(edge, "flush drop 5").headers["X-Cache-Status"] == "MISS"
    assert time.monotonic() - t0 < 2
    # the write that fitted reaches Redis with the next flush
    procs.wait_until(lambda: int(r.hget(keynames.CACHE_STATS, "stores") or 0) >= 1, 8,
                     what="the queued store written")
    assert int(r.hget(keynames.CACHE_STATS, "misses") or 0) == 7  # counters are never dropped
    assert "queue" not in edge.error_log()


def test_waiters_go_to_a_node_when_the_leader_stores_nothing(redis_server, tiny_upstreams,
                                                             edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    up.mode = "fail"
    up.delay_s = 1.0
    edge = cache_edge(redis_server, [up], edge_factory, {"coalesce_wait_s": 20.0},
                      max_tries=1, breaker_failures=1000, workers=2)
    peak = {"n": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["n"] = max(peak["n"], up.inflight)
            time.sleep(0.01)

    def burst(n: int) -> list[tuple[int, float]]:
        out: list[tuple[int, float]] = []
        lock = threading.Lock()

        def one() -> None:
            t0 = time.monotonic()
            res = chat(edge, "flush coalesce unstorable")
            with lock:
                out.append((res.status_code, time.monotonic() - t0))

        ts = [threading.Thread(target=one) for _ in range(n)]
        for t in ts:
            t.start()
            time.sleep(0.05)
        for t in ts:
            t.join(30)
        return out

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        first = burst(4)
        # waiters were released when the leader's 500 ended, long before coalesce_wait_s
        assert len(first) == 4 and all(s == 500 for s, _ in first)
        assert max(t for _, t in first) < 8
        assert up.hits == 4
        peak["n"] = 0
        # identical requests now go to the node together: nothing to wait for
        second = burst(4)
        assert len(second) == 4 and up.hits == 8
        assert peak["n"] == 4
    finally:
        stop.set()
        sampler.join()


def test_a_generation_longer_than_the_coalescing_wait_is_still_one_node_request(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """A waiter not streamed waits for the leader up to its own deadline, not
    coalesce_wait_s: an answer that takes longer than coalesce_wait_s is one node
    request, served to the waiter as a HIT (before, the waiter went to the node after
    coalesce_wait_s and generated it again). A streamed waiter goes on after
    coalesce_stream_wait_s (its client sees nothing while it waits), its first byte
    long before the leader's answer ends."""
    (up,) = tiny_upstreams(1)
    up.delay_s = 2.5
    edge = cache_edge(redis_server, [up], edge_factory, {"coalesce_wait_s": 1.0,
                                                         "coalesce_stream_wait_s": 0.3})
    with ThreadPoolExecutor(2) as pool:
        lead = pool.submit(chat, edge, "coalesce a long one")
        procs.wait_until(lambda: up.inflight == 1, 10, what="the leader at the node")
        wait = pool.submit(chat, edge, "coalesce a long one")
        first, second = lead.result(30), wait.result(30)
    assert first.headers["X-Cache-Status"] == "MISS"
    assert second.status_code == 200 and second.headers["X-Cache-Status"] == "HIT"
    assert up.hits == 1

    body = {"model": "m", "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "coalesce a long stream"}]}

    def stream() -> requests.Response:
        return requests.post(edge.url + CHAT, json=body, timeout=30)

    up.delay_s = 0.8     # under coalesce_wait_s: a waiter not streamed would get the HIT
    with ThreadPoolExecutor(2) as pool:
        lead = pool.submit(stream)
        procs.wait_until(lambda: up.inflight == 1, 10, what="the streamed leader at the node")
        wait = pool.submit(stream)
        first, second = lead.result(30), wait.result(30)
    assert first.status_code == 200 and second.status_code == 200
    assert second.headers["X-Cache-Status"] == "MISS" and up.hits == 3


def test_a_worker_that_exits_still_writes_what_its_last_requests_store(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """nginx reloads (``up`` reloads it when its embedder dies or returns): the old worker
    runs its flush timer one last time at once and finishes its requests afterwards. Their
    cache store and the release of the coalescing lock still reach Redis, so an identical
    request is a HIT; without, it waits coalesce_wait_s for a lock nobody releases."""
    (up,) = tiny_upstreams(1)
    up.delay_s = 1.5                     # the answer comes after the reload
    edge = cache_edge(redis_server, [up], edge_factory, {"coalesce_wait_s": 20.0})
    r = redis_server.client()
    got: dict = {}

    def first() -> None:
        got["res"] = chat(edge, "flush across a reload")

    t = threading.Thread(target=first)
    t.start()
    try:
        procs.wait_until(lambda: up.inflight == 1, 10, what="the request to reach the node")
        old = children(edge.managed.pid)
        edge.managed.signal(signal.SIGHUP)
        procs.wait_until(lambda: children(edge.managed.pid) - old, 10,
                         what="new workers after the reload")
    finally:
        t.join(20)
    assert got["res"].status_code == 200 and got["res"].headers["X-Cache-Status"] == "MISS"
    up.delay_s = 0.0
    procs.wait_until(lambda: int(r.hget(keynames.CACHE_STATS, "stores") or 0) >= 1, 5,
                     what="the answer stored by the exiting worker")
    res = chat(edge, "flush across a reload", timeout=5)
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "HIT", res.headers


def test_an_answer_read_on_after_its_client_left_is_served_to_the_requests_waiting_on_it(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """On llama.cpp nodes the relay reads an answer whose client left to its end (the
    node writes it anyway): it is stored, so an identical request coalesced on it gets it
    as a HIT instead of generating it again after the leader's node finished."""
    from support.stack import write_snapshot

    ups = tiny_upstreams(names=["a", "b"])
    for u in ups:
        u.delay_s = 1.5
    edge = cache_edge(redis_server, [], edge_factory, {"coalesce_wait_s": 5.0},
                      stale_after_s=3600, workers=1)
    snap = write_snapshot(redis_server.client(), [
        u.snapshot_node(kind="openai", slots=2, slots_source="server", score=None,
                        has_metrics=False) for u in ups])
    edge.wait_snapshot(snap["version"])
    with ThreadPoolExecutor(2) as pool:
        lead = pool.submit(chat, edge, "left by its client", None, 0.5)
        procs.wait_until(lambda: sum(u.inflight for u in ups) == 1, 10,
                         what="the leader at a node")
        wait = pool.submit(chat, edge, "left by its client")
        with pytest.raises(requests.exceptions.ReadTimeout):
            lead.result(30)
        second = wait.result(30)
    assert second.status_code == 200 and second.headers["X-Cache-Status"] == "HIT"
    assert sum(u.hits for u in ups) == 1
