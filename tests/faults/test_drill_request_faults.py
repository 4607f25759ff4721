"""Drills: one tenant's requests cannot take the pool away from everyone.

Steady load (10 requests/s, API keys required) through an edge in front of three
simulated nodes and a control plane, while

- 10 poison requests arrive within 0.2 s: a body nested 990 deep, under lua-cjson's limit
  of 1000, on which the Python simnodes fail with 500 (RecursionError). With the default
  edge.max_json_depth (64) the edge refuses them (400 json_too_deep) and no node sees
  them; with the limit raised to 1000 they reach the nodes, are tried on two nodes each,
  and count against none;
- 15 concurrent generations run past the request deadline (504 deadline_exceeded).

Bound: no legitimate request answered 503 (or any 5xx), at least 95 % answered 200, and
no circuit breaker opened."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.config import settings_from_dict

pytestmark = pytest.mark.integration

POISON = ('{"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "x": %s}'
          % ('{"a":' * 990 + "1" + "}" * 990))


def _stack(redis_server, simnodes, controlplane_factory, edge_factory, *, time_scale=0.05,
           edge=None, deadlines=None):
    nodes = simnodes(3, time_scale=time_scale)
    s = settings_from_dict({
        "redis": {"url": redis_server.url},
        "auth": {"mode": "required"},
        "edge": {"workers": 1, "sync_interval_s": 0.1, "read_timeout_ms": 10000,
                 "breaker_failures": 5, "breaker_cooldown_s": 10.0, **(edge or {})},
        "controlplane": {"poll_interval_s": 0.3, "leader_ttl_s": 2.0},
        "deadlines": deadlines or {},
        "nodes": [n.node_settings().model_dump() for n in nodes],
    })
    controlplane_factory(s)
    e = edge_factory(s)
    procs.wait_until(lambda: sum(n["eligible"] for n in e.status()["nodes"]) == 3, 15,
                     what="three nodes eligible")
    key, _ = apikeys.create_key(redis_server.client(), "drill")
    return e, nodes, {"Authorization": f"Bearer {key}"}


def _breakers(edge) -> dict[str, str]:
    return {n["name"]: n["breaker"] for n in edge.status()["nodes"]}


def _burst(n: int, span_s: float, fn) -> list:
    """``n`` calls of ``fn`` started evenly within ``span_s`` seconds, all at once."""
    out: list = [None] * n

    def one(i: int) -> None:
        out[i] = fn()

    threads = []
    for i in range(n):
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(span_s / n)
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("depth", [64, 1000], ids=["default-depth", "depth-1000"])
def test_poison_burst_takes_no_node_away(depth, redis_server, simnodes, controlplane_factory,
                                         edge_factory, load_loop, output_dir) -> None:
    edge, nodes, h = _stack(redis_server, simnodes, controlplane_factory, edge_factory,
                            edge={"max_json_depth": depth})
    load = load_loop(f"poison burst (max_json_depth {depth})", [edge], rate_per_s=10, headers=h)
    load.wait_sent(10)
    load.phase("poison")
    t0 = time.monotonic()
    poison = _burst(10, 0.2, lambda: requests.post(
        f"{edge.url}/v1/chat/completions", data=POISON,
        headers={**h, "Content-Type": "application/json"}, timeout=30))
    burst_s = time.monotonic() - t0
    load.wait_sent(10)
    load.phase("after")
    load.wait_sent(20)
    report = load.stop()
    # every load request reached one node once (no cache, no retry): the rest is poison
    node_hits = sum(n.state()["requests_total"] for n in nodes) - report.sent
    codes = sorted({(p.status_code, p.json()["error"]["code"]) for p in poison})
    summary = report.report(output_dir, poison_answers=codes, poison_burst_s=round(burst_s, 2),
                            poison_tries_at_nodes=node_hits, breakers=_breakers(edge))
    assert report.by_status().get("503", 0) == 0, summary
    assert not [k for k in report.by_status() if k.startswith("5")], summary
    assert report.ok_ratio() >= 0.95, summary
    assert set(_breakers(edge).values()) == {"closed"}, summary
    assert "circuit breaker" not in edge.error_log()
    if depth == 64:
        assert codes == [(400, "json_too_deep")] and node_hits == 0, summary
    else:
        assert codes == [(500, "upstream_error")] and node_hits == 20, summary


def test_generations_past_the_deadline_open_no_breaker(redis_server, simnodes, controlplane_factory,
                                                       edge_factory, load_loop, output_dir) -> None:
    # 400 tokens at ~20 ms each, time scale 0.25: ~2 s of wall time, past the 1.5 s deadline
    edge, nodes, h = _stack(redis_server, simnodes, controlplane_factory, edge_factory,
                            time_scale=0.25, deadlines={"request_ms": 1500})
    load = load_loop("generations past the deadline", [edge], rate_per_s=10, headers=h)
    load.wait_sent(10)
    load.phase("long generations")
    body = {"model": "sim-llama", "sim_output_tokens": 400,
            "messages": [{"role": "user", "content": "a very long story"}]}
    with ThreadPoolExecutor(15) as pool:
        long = list(pool.map(lambda _: requests.post(f"{edge.url}/v1/chat/completions", json=body,
                                                     headers=h, timeout=30), range(15)))
    load.phase("after")
    load.wait_sent(15)
    report = load.stop()
    codes = sorted({(x.status_code, x.json()["error"]["code"]) for x in long})
    summary = report.report(output_dir, long_answers=codes, breakers=_breakers(edge),
                            cancelled_at_nodes=sum(n.state()["cancelled_total"] for n in nodes))
    assert codes == [(504, "deadline_exceeded")], summary
    assert report.by_status().get("503", 0) == 0, summary
    assert not [k for k in report.by_status() if k.startswith("5")], summary
    assert report.ok_ratio() >= 0.95, summary
    assert set(_breakers(edge).values()) == {"closed"}, summary
    assert all(n["failures"] == 0 for n in edge.status()["nodes"]), edge.status()["nodes"]
