"""Others' requests on a node (lua/infergate/routing/others.lua): a node whose own
metrics show it running and queueing requests that cannot be this edge's (other edges,
clients past the gateway) is not free, though this edge has nothing in flight there.
Snapshots are written straight into Redis; the nodes are tiny upstreams with known
slots."""

from __future__ import annotations

import threading
import time

import requests

from controlplane import procs
from support.stack import edge_on_snapshot, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _edge(redis_server, edge_factory, nodes):
    return edge_on_snapshot(redis_server, edge_factory, nodes, read_timeout_ms=60000)


def _node(up, **kw):
    return up.snapshot_node(slots=1, slots_source="server", score=None, **kw)


def _post(edge, text: str = "hi") -> requests.Response:
    body = {**CHAT, "messages": [{"role": "user", "content": text}]}
    return requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=30)


def test_a_node_its_metrics_show_full_of_others_requests_gets_none(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """Two one-slot nodes; "taken" reports 1 running and 1 waiting in a fresh poll, this
    edge has nothing there: every request goes to "free", one at a time, and the status
    shows the 2 others' requests. A poll older than the freshness bound says nothing:
    both nodes get requests again."""
    taken, free = tiny_upstreams(names=["taken", "free"])
    now = time.time()
    edge = _edge(redis_server, edge_factory,
                 [_node(taken, running=1, queue_depth=1, polled_at=now),
                  _node(free, running=0, queue_depth=0, polled_at=now)])
    assert edge.node_status("taken")["others"] == 2
    assert edge.node_status("free")["others"] == 0
    for i in range(8):
        assert _post(edge, f"q{i}").status_code == 200
    assert taken.hits == 0 and free.hits == 8

    # the same figures from a poll 10 s old: not counted
    old = time.time() - 10
    snap = write_snapshot(redis_server.client(),
                          [_node(taken, running=1, queue_depth=1, polled_at=old),
                           _node(free, running=0, queue_depth=0, polled_at=old)])
    edge.wait_snapshot(snap["version"])
    assert edge.node_status("taken")["others"] == 0
    procs.wait_until(lambda: _post(edge).status_code == 200 and taken.hits > 0, 20,
                     what="a request on the node whose figures are stale")


def test_an_answer_of_this_edge_after_the_poll_is_not_taken_for_others(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """The node answered this edge after its last poll: the poll's figures may hold that
    answer, so they do not count as others'; a poll after it does count."""
    (up,) = tiny_upstreams(names=["one"])
    edge = _edge(redis_server, edge_factory, [_node(up, running=0, queue_depth=0,
                                                    polled_at=time.time())])
    assert _post(edge).status_code == 200
    ended = time.time()
    r = redis_server.client()
    snap = write_snapshot(r, [_node(up, running=1, queue_depth=0, polled_at=ended - 0.5)])
    edge.wait_snapshot(snap["version"])
    assert edge.node_status("one")["others"] == 0
    later = time.time() + 1.5     # the poll came after this edge's answer ended
    snap = write_snapshot(r, [_node(up, running=1, queue_depth=0, polled_at=later)])
    edge.wait_snapshot(snap["version"])
    assert edge.node_status("one")["others"] == 1


def test_a_request_waits_at_the_edge_until_others_free_the_only_slot(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """One one-slot node full of others' requests: a request waits at the edge, not in
    the node's queue, and is sent once a poll shows the slot free."""
    (up,) = tiny_upstreams(names=["one"])
    r = redis_server.client()
    edge = _edge(redis_server, edge_factory, [_node(up, running=1, queue_depth=0,
                                                    polled_at=time.time())])
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(_post(edge).status_code))
    t.start()
    try:
        procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 1, 10,
                         what="the request waiting at the edge")
        assert up.hits == 0
        write_snapshot(r, [_node(up, running=0, queue_depth=0, polled_at=time.time())])
        t.join(20)
    finally:
        t.join(30)
    assert out == [200] and up.hits == 1
