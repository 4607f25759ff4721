"""Outlier detection on time to first byte at the edge (lua/infergate/routing/outlier.lua)
against tiny upstreams: a node that accepts requests and never answers gets no new
request once one of its requests waited past the threshold, without any health poll or
breaker; it gets requests again when it answers, and when every node is an outlier the
edge still routes."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from support.stack import edge_settings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _post(edge, timeout: float = 20) -> requests.Response:
    return requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=timeout)


def _wait(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def pair(tiny_upstreams, redis_server, edge_factory):
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      outlier_ttfb_min_s=0.5, outlier_ttfb_factor=5.0,
                                      read_timeout_ms=15000))
    return edge, a, b


def test_a_hanging_node_stops_getting_requests_until_it_answers(pair) -> None:
    edge, a, b = pair
    for _ in range(10):                      # some TTFB history for both nodes
        assert _post(edge).status_code == 200
    a.mode = "hang"
    pool = ThreadPoolExecutor(8)
    stuck = []
    try:
        # requests until one is hanging on a
        while a.inflight < 1:
            stuck.append(pool.submit(_post, edge))
            time.sleep(0.05)
        time.sleep(0.8)                      # past the 0.5 s threshold
        before = a.hits
        seen = Counter(_post(edge).headers["X-Infergate-Node"] for _ in range(20))
        assert seen == {"b": 20}
        assert a.hits == before              # not even tried
        assert edge.node_status("a")["outlier"] is True
        assert "is an outlier" in edge.error_log()
        # a answers again (a slow answer, but a first byte): back in the pool
        a.mode = "ok"
        a.delay_s = 0.0
        a.release()
        for f in stuck:
            assert f.result(timeout=20).status_code == 200   # retried on b
        _wait(lambda: "a" in {_post(edge).headers["X-Infergate-Node"] for _ in range(10)})
    finally:
        a.release()
        pool.shutdown(wait=True)


def test_a_slow_answer_clears_the_outlier_at_once(pair) -> None:
    edge, a, b = pair
    for _ in range(10):
        assert _post(edge).status_code == 200
    a.delay_s = 1.5
    pool = ThreadPoolExecutor(4)
    try:
        slow = []
        while a.inflight < 1:
            slow.append(pool.submit(_post, edge))
            time.sleep(0.05)
        time.sleep(0.8)
        assert {_post(edge).headers["X-Infergate-Node"] for _ in range(10)} == {"b"}
        assert edge.node_status("a")["outlier"] is True
        a.delay_s = 0.0
        for f in slow:
            assert f.result(timeout=20).status_code == 200
        # the first byte came: no wait for the flag to expire
        st = edge.node_status("a")
        assert st["outlier"] is False
        assert st["ttfb_p90_s"]["plain"] >= 1.4            # the slow answer is in its history
        assert edge.node_status("b")["outlier"] is False
    finally:
        pool.shutdown(wait=True)


def test_every_node_an_outlier_still_routes(tiny_upstreams, redis_server, edge_factory) -> None:
    (a,) = tiny_upstreams(names=["solo"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()],
                                      outlier_ttfb_min_s=0.3, read_timeout_ms=15000))
    a.delay_s = 1.0
    pool = ThreadPoolExecutor(2)
    try:
        first = pool.submit(_post, edge)
        _wait(lambda: a.inflight >= 1)
        time.sleep(0.5)
        second = pool.submit(_post, edge)    # the only node: still sent there
        assert first.result(timeout=20).status_code == 200
        assert second.result(timeout=20).status_code == 200
    finally:
        pool.shutdown(wait=True)
