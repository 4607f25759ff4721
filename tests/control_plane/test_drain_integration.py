"""Drain and undrain across the whole stack: three simulated nodes, the control plane
(serving the admin API), one nginx edge, a real redis-server.

- A long stream in flight on a node finishes intact after the node is drained.
- While draining, new requests avoid the node; the node reaches ``drained`` once the
  stream is over.
- After undrain the node's share of traffic ramps up (slow start): its share in the
  first seconds is clearly below its share once the ramp is over.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from controlplane import procs
from controlplane.routing import registry
from support.stack import edge_settings

TOKEN = "drain-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LONG_TOKENS = 250
SLOW_START_S = 8.0


def short_request(edge_url: str, i: int) -> tuple[int, str]:
    """One small completion through the edge: (status, node that answered)."""
    res = requests.post(f"{edge_url}/v1/chat/completions", timeout=20, json={
        "model": "sim-llama", "max_tokens": 1,
        "messages": [{"role": "user", "content": f"short question {i}"}]})
    return res.status_code, res.headers.get("X-Sim-Node", "")


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_drain_finishes_streams_avoids_node_and_undrain_ramps(
        redis_server, simnodes, controlplane_factory, edge_factory):
    nodes = simnodes(3, names=["sim-a", "sim-b", "sim-c"], output_tokens=f"{LONG_TOKENS}:{LONG_TOKENS}")
    settings = edge_settings(redis_server.url, [n.node_settings() for n in nodes])
    cp_s = settings.controlplane
    cp_s.admin_token = TOKEN
    cp_s.poll_interval_s = 0.2
    cp_s.poll_timeout_s = 0.5
    cp_s.leader_ttl_s = 2.0
    cp_s.slow_start_s = SLOW_START_S
    cp_s.drain_timeout_s = 120.0
    cp = controlplane_factory(settings)
    edge = edge_factory(settings)
    r = redis_server.client()
    api = cp.admin_url + "/api/v1"
    by_name = {n.name: n for n in nodes}

    procs.wait_until(lambda: all(n["eligible"] for n in edge.status()["nodes"])
                     and len(edge.status()["nodes"]) == 3, 20,
                     what="edge routing on all three nodes from the snapshot")

    # 1. a long stream lands on some node: that node is drained
    stream = requests.post(f"{edge.url}/v1/chat/completions", stream=True, timeout=60, json={
        "model": "sim-llama", "stream": True, "max_tokens": LONG_TOKENS,
        "messages": [{"role": "user", "content": "tell me a long story"}]})
    assert stream.status_code == 200
    victim = stream.headers["X-Sim-Node"]
    lines = stream.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line)
    assert first.startswith("data: {")

    res = requests.post(f"{api}/nodes/{victim}/drain", headers=AUTH, timeout=5)
    assert res.status_code == 200 and res.json()["state"] == "draining"
    procs.wait_until(lambda: edge.node_status(victim)["state"] == "draining", 10,
                     what="edge to see the drain")
    assert by_name[victim].state()["running"] >= 1, "the long stream should still be running"
    assert registry.get_state(r, victim).state == "draining"

    # 2. new requests avoid the draining node
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: short_request(edge.url, i), range(40)))
    assert all(status == 200 for status, _ in answers), answers
    served = {node for _, node in answers}
    assert victim not in served and served <= set(by_name) - {victim}

    # 3. the stream finishes intact
    text, finish, done = [], None, False
    for line in [first, *lines]:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            break
        ev = json.loads(payload)
        assert "error" not in ev, ev
        for ch in ev["choices"]:
            text.append(ch["delta"].get("content") or "")
            finish = ch.get("finish_reason") or finish
    assert done and finish in ("length", "stop")
    assert "".join(text).strip()
    completion = by_name[victim].state()
    assert completion["running"] == 0

    # 4. the control plane marks it drained once nothing is in flight
    def drained() -> bool:
        return requests.get(f"{api}/nodes/{victim}", headers=AUTH, timeout=5).json()["state"] == "drained"

    procs.wait_until(drained, 20, what=f"{victim} drained")
    kinds = [e["kind"] for e in registry.recent_events(r, 50, node=victim)]
    assert "drain" in kinds and "drained" in kinds

    # 5. undrain: its share ramps up over slow_start_s
    res = requests.post(f"{api}/nodes/{victim}/undrain", headers=AUTH, timeout=5)
    assert res.status_code == 200 and res.json()["state"] == "active"
    t0 = time.monotonic()
    stop_at = t0 + SLOW_START_S + 3.0
    log: list[tuple[float, str]] = []
    lock = threading.Lock()

    def load(worker: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            status, node = short_request(edge.url, worker * 100000 + i)
            i += 1
            assert status == 200
            with lock:
                log.append((time.monotonic() - t0, node))

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(load, w) for w in range(4)]:
            f.result()

    def share(lo: float, hi: float) -> tuple[float, int]:
        window = [node for t, node in log if lo <= t < hi]
        assert len(window) >= 30, f"too few requests in [{lo}, {hi}) s: {len(window)}"
        return sum(1 for n in window if n == victim) / len(window), len(window)

    early, n_early = share(0.0, 1.5)
    late, n_late = share(SLOW_START_S + 0.5, SLOW_START_S + 3.0)
    msg = f"{victim}: early share {early:.2f} of {n_early}, late share {late:.2f} of {n_late}"
    assert late > 0.15, msg
    assert early < 0.75 * late, msg  # no ramp: early ≈ late
