"""A node restarted under the edge's requests (lua/infergate/routing/restarts.lua): once
the routing snapshot says its process was replaced after a relayed request was sent to
it ("restarted_after"), the request, which got no byte back, is retried on another node
instead of waiting out its deadline on a connection the old process never answers
(which requests stay: tests/lua/test_restarts_lua.py)."""

from __future__ import annotations

import threading
import time

import requests

from controlplane import procs
from support.stack import edge_on_snapshot, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _one_on(up, edge) -> tuple[threading.Thread, list]:
    """A request that the edge sent to ``up`` (which holds it): sent again until one
    lands there (the others are answered by the other node at once)."""
    out: list = []
    for _ in range(20):
        before = up.hits
        t = threading.Thread(target=lambda: out.append(requests.post(
            f"{edge.url}/v1/chat/completions", json=CHAT, timeout=5)))
        t.start()
        procs.wait_until(lambda: up.hits > before or not t.is_alive(), 10,
                         what="the request on a node")
        if up.hits > before:
            return t, out
        t.join(10)
        out.clear()
    raise AssertionError("no request reached the held node")


def test_a_request_held_by_a_replaced_process_is_retried_elsewhere(
        tiny_upstreams, redis_server, edge_factory) -> None:
    old, other = tiny_upstreams(names=["old", "other"])
    old.mode = "hang"          # accepts, never answers: the stopped process's connections
    r = redis_server.client()

    def nodes(**kw) -> list[dict]:
        return [old.snapshot_node(score=None, **kw), other.snapshot_node(score=None)]

    edge = edge_on_snapshot(redis_server, edge_factory, nodes(), workers=1)
    t, out = _one_on(old, edge)
    # the process it was sent to was last seen after it was sent: retried on "other"
    # at the leg's next look, well within the client's 5 s (without the restart, the
    # leg waits for the node's head up to twice its TTFB outlier bound, 10 s)
    write_snapshot(r, nodes(restarted_after=time.time() + 1.5))
    t.join(12)
    assert out and out[0].status_code == 200, out
    assert out[0].headers["X-Infergate-Node"] == "other"
    assert edge.node_status("old")["inflight"] == 0
    old.release()
