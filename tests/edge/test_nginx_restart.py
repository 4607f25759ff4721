"""nginx's master killed under a supervisor (as `infergate up` runs it): the orphaned
workers finish the requests they serve while a new master takes the port (real nginx,
real HTTP)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import requests

from controlplane import procs
from support.stack import edge_settings

pytestmark = pytest.mark.integration


def test_a_stream_in_flight_survives_the_masters_death(redis_server, tiny_upstreams,
                                                       edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    up.gate = threading.Event()      # the stream waits before its last chunk
    edge = edge_factory(edge_settings(redis_server.url, [up.node_settings()]))
    got: dict = {}

    def stream() -> None:
        try:
            r = requests.post(edge.url + "/v1/chat/completions", stream=True, timeout=30,
                              json={"model": "m", "stream": True,
                                    "messages": [{"role": "user", "content": "hold on"}]})
            got["status"] = r.status_code
            got["body"] = b"".join(r.iter_content(None))
        except requests.RequestException as exc:
            got["error"] = repr(exc)

    t = threading.Thread(target=stream)
    t.start()
    procs.wait_until(lambda: up.inflight == 1, 10, what="the stream to reach the node")

    lines: list[str] = []
    sup = procs.Supervisor(lines.append, procs.RestartPolicy(initial_s=0.05, max_s=0.2))
    m = sup.watch(edge.managed)
    old = m.pid
    os.kill(old, signal.SIGKILL)

    def restarted() -> bool:
        assert sup.tick() is None
        if m.pid == old:
            return False
        try:
            return requests.post(edge.url + "/v1/chat/completions", timeout=5, json={
                "model": "m", "messages": [{"role": "user", "content": "new one"}]}).status_code == 200
        except requests.RequestException:
            return False

    procs.wait_until(restarted, 20, interval=0.1, what="a new master answering")
    assert m.orphan_groups == [old]   # the old workers were asked to finish, not killed
    up.gate.set()
    t.join(20)
    assert got.get("status") == 200, got
    assert got["body"].rstrip().endswith(b"data: [DONE]"), got["body"][-200:]
    assert any(ln.startswith("nginx exited (code -9") for ln in lines), lines
