"""Deadline-aware admission at the edge (lua/infergate/admission/shed.lua with
lua/infergate/routing/speed.lua) against a tiny upstream: with its only node at its
max_concurrency, a request the node can still finish before the deadline is admitted
instead of shed, one it cannot is shed with Retry-After from the predicted wait."""

from __future__ import annotations

import threading
import time

import requests

from support.stack import edge_settings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _edge(tiny_upstreams, redis_server, edge_factory, delay_s: float, request_ms: int):
    (up,) = tiny_upstreams(names=["only"])
    up.delay_s = delay_s
    settings = edge_settings(redis_server.url, [up.node_settings(max_concurrency=1)],
                             read_timeout_ms=20000)
    settings.admission.max_wait_ms = 100
    settings.deadlines.request_ms = request_ms
    return edge_factory(settings), up


def _post(edge, **kw) -> requests.Response:
    return requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, **kw}, timeout=30)


def _hold_one(edge, up) -> threading.Thread:
    """A stream kept open on the node (it waits at its last chunk for up.gate)."""
    up.gate = threading.Event()
    th = threading.Thread(target=lambda: _post(edge, stream=True).content, daemon=True)
    th.start()
    end = time.monotonic() + 10
    while edge.node_status("only")["inflight"] < 1:
        assert time.monotonic() < end
        time.sleep(0.02)
    return th


def test_a_request_that_fits_the_deadline_is_admitted(tiny_upstreams, redis_server,
                                                      edge_factory) -> None:
    edge, up = _edge(tiny_upstreams, redis_server, edge_factory, 0.05, 10000)
    for _ in range(3):
        assert _post(edge).status_code == 200            # latency history: ~0.05 s
    th = _hold_one(edge, up)
    try:
        res = _post(edge)                                # the node is at max_concurrency 1
        assert res.status_code == 200, res.text
        assert edge.status()["admission"]["shed"] == 0
    finally:
        up.gate.set()
        th.join(10)


def test_a_request_that_cannot_fit_is_shed_with_the_predicted_wait(tiny_upstreams, redis_server,
                                                                   edge_factory) -> None:
    edge, up = _edge(tiny_upstreams, redis_server, edge_factory, 1.5, 2500)
    assert _post(edge).status_code == 200                # unqueued latency ~1.5 s
    th = _hold_one(edge, up)
    try:
        res = _post(edge)            # predicted 1.5 s wait + 1.5 s own > 2.5 s deadline
        assert res.status_code == 429, res.text
        assert res.json()["error"]["code"] == "nodes_saturated"
        assert res.headers["Retry-After"] == "2"         # ceil(1.5 s predicted wait)
    finally:
        up.gate.set()
        th.join(10)
