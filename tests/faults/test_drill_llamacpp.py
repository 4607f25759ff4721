"""Drill: two llama-cpp-python-like nodes (``infergate simnode --llamacpp``: one request at
a time behind a model lock, no /health, a /v1/models call that waits for the lock and
ends the running stream) behind an edge, with the control plane polling them every
0.3 s as ``kind = "openai"`` nodes and API keys required.

Bound: 10 of 10 streams through the edge complete (final chunk and ``[DONE]``), no
stream is interrupted, the control plane never calls /v1/models; a node busy with a
10 s generation (simulated seconds, scaled by the time scale) stays healthy the whole
time and the steady load meanwhile gets no 5xx."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.config import settings_from_dict
from controlplane.redisdb import keynames

pytestmark = pytest.mark.integration

TIME_SCALE = 0.3


def _stack(redis_server, simnodes, controlplane_factory, edge_factory):
    nodes = simnodes(2, "--llamacpp", time_scale=TIME_SCALE)
    s = settings_from_dict({
        "redis": {"url": redis_server.url},
        "auth": {"mode": "required"},
        "edge": {"workers": 1, "sync_interval_s": 0.1, "read_timeout_ms": 30000},
        "controlplane": {"poll_interval_s": 0.3, "poll_timeout_s": 0.25, "leader_ttl_s": 2.0},
        "deadlines": {"request_ms": 60000},
        "nodes": [n.node_settings(kind="openai", max_concurrency=1).model_dump() for n in nodes],
    })
    controlplane_factory(s)
    edge = edge_factory(s)
    procs.wait_until(lambda: sum(n["eligible"] for n in edge.status()["nodes"]) == 2, 15,
                     what="both nodes eligible")
    key, _ = apikeys.create_key(redis_server.client(), "drill")
    return edge, nodes, {"Authorization": f"Bearer {key}"}


def _stream(edge, h: dict, tokens: int) -> dict:
    body = {"model": "sim-llama", "stream": True, "sim_output_tokens": tokens,
            "messages": [{"role": "user", "content": "tell me a story"}]}
    with requests.post(f"{edge.url}/v1/chat/completions", json=body, headers=h, stream=True,
                       timeout=60) as res:
        lines = [ln[6:] for ln in res.iter_lines() if ln.startswith(b"data: ")]
        node = res.headers.get("X-Infergate-Node")
    events = [json.loads(x) for x in lines if x != b"[DONE]"]
    finished = any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
    return {"status": res.status_code, "node": node, "complete": finished and lines[-1:] == [b"[DONE]"]}


def _healthy_watch(r: redis.Redis, stop: threading.Event, seen: list) -> None:
    while not stop.is_set():
        raw = r.get(keynames.ROUTING)
        if raw:
            seen.append({n["name"]: n["healthy"] for n in json.loads(raw)["nodes"]})
        stop.wait(0.1)


def test_streams_complete_and_a_busy_node_stays_healthy(redis_server, simnodes, controlplane_factory,
                                                       edge_factory, load_loop, output_dir) -> None:
    edge, nodes, h = _stack(redis_server, simnodes, controlplane_factory, edge_factory)
    stop = threading.Event()
    health: list[dict] = []
    watcher = threading.Thread(target=_healthy_watch, args=(redis_server.client(), stop, health))
    watcher.start()
    try:
        # 10 streams of ~1 s each (150 tokens), two at a time: one per node
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            streams = list(pool.map(lambda _: _stream(edge, h, 150), range(10)))
        streams_s = time.monotonic() - t0

        # one node busy with a 10 s generation (500 tokens x 20 ms), under steady load
        load = load_loop("llamacpp busy node", [edge], rate_per_s=10, headers=h)
        load.wait_sent(5)
        load.phase("busy")
        long_body = {"model": "sim-llama", "sim_output_tokens": 500,
                     "messages": [{"role": "user", "content": "a very long story"}]}
        t1 = time.monotonic()
        long = requests.post(f"{edge.url}/v1/chat/completions", json=long_body, headers=h, timeout=60)
        busy_s = time.monotonic() - t1
        report = load.stop()
    finally:
        stop.set()
        watcher.join(5)
    busy_node = long.headers.get("X-Infergate-Node")
    states = [n.state() for n in nodes]
    unhealthy = [p for p in health if not all(p.values())]
    summary = report.report(
        output_dir, streams_complete=sum(s["complete"] for s in streams), streams=len(streams),
        streams_s=round(streams_s, 1), busy_node=busy_node, busy_wall_s=round(busy_s, 1),
        snapshots_watched=len(health), snapshots_with_an_unhealthy_node=len(unhealthy),
        interrupted=sum(s["interrupted_total"] for s in states),
        models_calls=sum(s["by_path"].get("/v1/models", 0) for s in states))
    assert all(s["status"] == 200 for s in streams), streams
    assert sum(s["complete"] for s in streams) == 10, streams
    assert {s["node"] for s in streams} == {n.name for n in nodes}
    assert sum(s["interrupted_total"] for s in states) == 0, summary
    assert sum(s["by_path"].get("/v1/models", 0) for s in states) == 0, summary
    assert long.status_code == 200, long.text
    assert busy_s >= 10 * TIME_SCALE * 0.8, busy_s
    assert len(health) >= 20 and not unhealthy, summary
    assert not [k for k in report.by_status() if k.startswith("5")], summary
    assert report.ok_ratio() >= 0.95, summary
