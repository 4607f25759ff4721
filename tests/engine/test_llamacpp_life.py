"""A real llama.cpp node's life behind ``infergate up --node URL --node URL``: healthy
while it generates (busy is not down), down when its process is killed (requests go to
the other node, none fails), back when it is started again on the same address, and
read again at once when it was restarted with other slots between two polls."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import redis
import requests

from bench.realnode import MODEL_ALIAS, RealNode
from controlplane import procs
from controlplane.redisdb import keynames
from support.upstack import UpStack

pytestmark = pytest.mark.integration

#: Seconds for the control plane to see a node change (polls every second; a node is
#: down after 3 failed polls, up again after 2 good ones).
CHANGE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def stack(realnodes):
    nodes = realnodes(2, parallel=2, threads=1)
    folder = Path(tempfile.mkdtemp(prefix="infergate-engine-life-"))
    up = UpStack.start(folder, "[cache]\nenabled = false\n",
                       *[a for n in nodes for a in ("--node", n.url)])
    try:
        assert up.proc.poll() is None, up.text()
        yield up, nodes
    finally:
        up.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _nodes(up: UpStack) -> dict[str, dict]:
    raw = redis.Redis.from_url(up.redis_url, decode_responses=True,
                               socket_timeout=2).get(keynames.ROUTING)
    return {n["url"]: n for n in (json.loads(raw)["nodes"] if raw else [])}


def _health(up: UpStack) -> dict[str, bool]:
    return {url: bool(n["healthy"]) for url, n in _nodes(up).items()}


def _chat(up: UpStack, max_tokens: int = 8) -> requests.Response:
    return requests.post(f"{up.base}/v1/chat/completions", timeout=120,
                         headers={"Authorization": f"Bearer {up.key}"},
                         json={"model": MODEL_ALIAS, "max_tokens": max_tokens,
                               "messages": [{"role": "user", "content": "Count to ten."}]})


def test_busy_is_healthy_killed_is_down_restarted_is_back(stack) -> None:
    up, (a, b) = stack
    procs.wait_until(lambda: _health(up) == {a.url: True, b.url: True},
                     timeout=CHANGE_TIMEOUT_S, what="both nodes healthy")
    # busy: both slots of both nodes generating long answers, the nodes stay healthy
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(_chat(up, 120).status_code))
               for _ in range(4)]
    for t in threads:
        t.start()
    seen_busy_healthy = []
    for t in threads:
        while t.is_alive():
            seen_busy_healthy.append(all(_health(up).values()))
            t.join(0.5)
    assert results == [200] * 4 and all(seen_busy_healthy), (results, seen_busy_healthy)
    # killed: down, and every request goes to the other node
    a.stop()
    procs.wait_until(lambda: _health(up).get(a.url) is False, timeout=CHANGE_TIMEOUT_S,
                     what="the killed node down")
    assert [_chat(up).status_code for _ in range(3)] == [200] * 3
    # started again on the same address: back
    again = RealNode(port=a.port, parallel=2, threads=1).start()   # its log in a temp folder
    logs = again.temp_log_dir
    assert logs is not None and logs.is_dir()
    try:
        procs.wait_until(lambda: _health(up).get(a.url) is True, timeout=CHANGE_TIMEOUT_S,
                         what="the restarted node healthy again")
        assert _chat(up).status_code == 200
    finally:
        again.stop()
    assert not logs.exists()                  # removed by stop()


def test_a_node_restarted_with_other_slots_is_read_again_at_once(stack) -> None:
    """Stopped and started again with ``--parallel 3`` on the same address: its metrics'
    counters begin again, and the control plane reads its slots anew within seconds,
    not at the next scheduled read of ``/props`` (``controlplane.models_refresh_s``,
    60 s), whether or not it looked down in between."""
    up, (_, b) = stack
    procs.wait_until(lambda: _nodes(up).get(b.url, {}).get("slots") == 2,
                     timeout=CHANGE_TIMEOUT_S, what="the node's 2 slots known")
    res = requests.post(f"{b.url}/v1/chat/completions", timeout=120,   # counters above 0
                        json={"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert res.status_code == 200
    b.stop()
    again = RealNode(port=b.port, parallel=3, threads=1).start()
    try:
        procs.wait_until(lambda: _nodes(up).get(b.url, {}).get("slots") == 3,
                         timeout=CHANGE_TIMEOUT_S, what="the restarted node's 3 slots known")
        # the snapshot names when the old process was last seen: what the edges sent
        # before went to it (lua/infergate/routing/restarts.lua)
        assert _nodes(up)[b.url]["restarted_after"] is not None
        procs.wait_until(lambda: _health(up).get(b.url) is True, timeout=CHANGE_TIMEOUT_S,
                         what="the restarted node healthy")
    finally:
        again.stop()
