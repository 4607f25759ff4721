"""Learned concurrency at the edge (lua/infergate/routing/speed.lua) against simulated
nodes that run one request at a time and have no metrics, registered with the default
max_concurrency 64: a burst of concurrent requests is split evenly although one node's
latency history is worse, where max_concurrency alone let that history herd the burst
onto the other node."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests

from support.stack import edge_settings

CHAT = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}]}


def _post(edge) -> str:
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert res.status_code == 200, res.text
    return res.headers["X-Infergate-Node"]


def test_one_at_a_time_nodes_share_a_burst(simnodes, redis_server, edge_factory) -> None:
    a, b = simnodes(2, "--max-running", "1", "--output-tokens", "8:8", "--dialect", "none",
                    names=["one-a", "one-b"])
    settings = edge_settings(redis_server.url, [a.node_settings(kind="openai"),
                                                b.node_settings(kind="openai")],
                             read_timeout_ms=60000)
    settings.scoring.latency_norm_s = 3.0
    edge = edge_factory(settings)
    # history: one-a was slow for a while (its latency EWMA is high), then recovered
    a.set_faults(slowdown=5)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: _post(edge), range(12)))
    a.set_faults(slowdown=1)
    for name in ("one-a", "one-b"):
        st = edge.node_status(name)
        assert st["learned_concurrency"] is not None and st["learned_concurrency"] < 2, st
    splits = []
    for _ in range(3):
        with ThreadPoolExecutor(8) as pool:
            splits.append(Counter(pool.map(lambda _: _post(edge), range(8))))
    for split in splits:
        assert min(split["one-a"], split["one-b"]) >= 3, splits
