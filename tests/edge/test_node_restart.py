"""A node restarted under the edge's requests (lua/infergate/routing/restarts.lua): once
the routing snapshot says its process was replaced after a relayed request was sent to
it ("restarted_after"), the request, which got no byte back, is retried on another node
instead of waiting out its deadline on a connection the old process never answers
(which requests stay: tests/lua/test_restarts_lua.py)."""

from __future__ import annotations

import json
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


def test_a_stream_paused_on_a_replaced_process_is_continued_elsewhere(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A stream silent mid-answer goes on while its node answers a liveness check (a long
    prefill elsewhere on the node), but not once the snapshot says the node's process
    was replaced after the stream was sent: the answers then come from the new process,
    which never had the stream. The stream is continued on the other node at its next
    silent read, not held for its whole read bound (15 s here)."""
    old, other = tiny_upstreams(names=["old", "other"])
    for u in (old, other):
        u.chunks, u.chunk_interval_s = 6, 0.05
    old.gate = threading.Event()     # pauses before its last chunk; its /health answers
    r = redis_server.client()

    def nodes(**kw) -> list[dict]:
        return [old.snapshot_node(score=None, models=["tiny"], **kw),
                other.snapshot_node(score=None, models=["tiny"], effective_weight=1e-6)]

    edge = edge_on_snapshot(redis_server, edge_factory, nodes(), workers=1, stall_min_s=0.5,
                            read_timeout_ms=15000)
    out: list = []

    def stream() -> None:
        with requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                           stream=True, timeout=(2, 6)) as res:
            out.append((res.status_code, res.headers.get("X-Infergate-Node"),
                        b"".join(res.iter_content(None))))

    t = threading.Thread(target=stream)
    t.start()
    procs.wait_until(lambda: old.stream_chunks_sent == 5 or not t.is_alive(), 10,
                     what="the stream paused on old")
    write_snapshot(r, nodes(restarted_after=time.time() + 1.5))
    t.join(12)
    old.gate.set()
    assert out, "the client's 6 s read timeout: the stream waited on the old process"
    status, first, body = out[0]
    assert status == 200 and first == "old"
    events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and b"stream_interrupted" not in body, body[-400:]
    writers = [json.loads(e).get("system_fingerprint") for e in events[:-1]]
    assert writers[0] == "old" and writers[-1] == "other", writers
