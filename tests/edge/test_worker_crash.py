"""An nginx worker killed (or crashed) with requests in its hands: what those requests
held in the shared dicts is given back once the worker is gone, not kept until nginx
restarts (lua/infergate/core/workers.lua): the admission gauge of requests waiting at the
edge comes back to 0, and an identical request that waited for the dead worker's answer
(request coalescing) takes its lock over and goes to a node itself instead of waiting
out its deadline. Real nginx with one worker, killed with SIGKILL."""

from __future__ import annotations

import requests

from controlplane import procs
from support.stack import edge_on_snapshot, edge_settings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the same question"}]}


def test_requests_waiting_on_a_killed_worker_leave_the_waiting_gauge(
        tiny_upstreams, redis_server, edge_factory) -> None:
    (a,) = tiny_upstreams(names=["a"])
    a.mode = "hang"
    edge = edge_on_snapshot(redis_server, edge_factory,
                            [a.snapshot_node(slots=1, slots_source="server", score=None)],
                            workers=1, check_log=False)   # the kill's [alert] is expected
    out: list = []
    threads = [edge.post_in_background(
        {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}, out) for i in range(4)]
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 3, 15,
                     what="3 requests waiting at the edge behind the one on the node")
    edge.kill_workers()
    a.release()
    for t in threads:
        t.join(30)
    assert len(out) == 4
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 0, 15, interval=0.2,
                     what="the dead worker's waiting requests off the gauge")
    assert edge.status()["inflight_total"] == 0
    assert "taken off the admission gauge" in edge.error_log()


def test_an_identical_request_takes_over_the_lock_of_a_killed_leader(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """The first of identical requests (the coalescing leader) dies with its worker: the
    same request sent again (as a client retries a lost connection) goes to the node and
    is answered, instead of waiting for the dead leader up to its whole deadline."""
    (a,) = tiny_upstreams(names=["a"])
    a.mode = "hang"
    s = edge_settings(redis_server.url, [a.node_settings()], workers=1)
    s.deadlines.request_ms = 30000
    s.cache = s.cache.model_validate({"enabled": True, "semantic": False,
                                      "coalesce_wait_s": 10.0, "coalesce_poll_ms": 20})
    edge = edge_factory(s, check_log=False)
    out: list = []
    leader = edge.post_in_background(CHAT, out)
    procs.wait_until(lambda: a.inflight == 1, 15, what="the leader on the node")
    edge.kill_workers()
    leader.join(30)
    a.release()
    a.hold()
    a.mode = "ok"
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=8)
    assert res.status_code == 200, res.text
    assert a.hits == 2
