"""An nginx worker killed (or crashed) with requests in its hands: what those requests
held in the shared dicts is given back once the worker is gone, not kept until nginx
restarts (lua/infergate/core/workers.lua): the admission gauge of requests waiting at the
edge comes back to 0, and an identical request that waited for the dead worker's answer
(request coalescing) takes its lock over and goes to a node itself instead of waiting
out its deadline. Real nginx with one worker, killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import requests

from controlplane import procs
from support.stack import edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the same question"}]}


def _workers(edge) -> list[int]:
    master = int(Path(edge.rendered.prefix, "nginx.pid").read_text())

    def parent(pid: str) -> str | None:
        try:  # a process of another test may end between the listing and the read
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            return None

    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == str(master)]


def _kill_workers(edge) -> None:
    victims = _workers(edge)
    assert victims
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    procs.wait_until(lambda: not any(Path(f"/proc/{v}").exists() for v in victims), 10,
                     what="the killed workers reaped")
    procs.wait_until(lambda: len(_workers(edge)) == len(victims), 10,
                     what="nginx's new workers")


def _send(edge, out: list, body: dict = CHAT) -> threading.Thread:
    def one() -> None:
        try:
            out.append(requests.post(f"{edge.url}/v1/chat/completions", json=body,
                                     headers={"Connection": "close"}, timeout=30).status_code)
        except requests.RequestException:
            out.append(-1)   # the killed worker's clients lose their connection

    t = threading.Thread(target=one)
    t.start()
    return t


def test_requests_waiting_on_a_killed_worker_leave_the_waiting_gauge(
        tiny_upstreams, redis_server, edge_factory) -> None:
    (a,) = tiny_upstreams(names=["a"])
    a.mode = "hang"
    s = edge_settings(redis_server.url, [], workers=1, stale_after_s=3600)
    s.deadlines.request_ms = 30000
    edge = edge_factory(s, check_log=False)   # the killed worker's [alert] line is expected
    snap = write_snapshot(redis_server.client(),
                          [a.snapshot_node(slots=1, slots_source="server", score=None)])
    edge.wait_snapshot(snap["version"])
    out: list = []
    threads = [_send(edge, out, {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]})
               for i in range(4)]
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 3, 15,
                     what="3 requests waiting at the edge behind the one on the node")
    _kill_workers(edge)
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
    leader = _send(edge, out)
    procs.wait_until(lambda: a.inflight == 1, 15, what="the leader on the node")
    _kill_workers(edge)
    leader.join(30)
    a.release()
    a.hold()
    a.mode = "ok"
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=8)
    assert res.status_code == 200, res.text
    assert a.hits == 2
