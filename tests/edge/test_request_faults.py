"""A request's own fault is not a node's fault (lua/infergate/log.lua,
lua/infergate/routing/balancer.lua): with real nginx and simulated nodes, a body every
node fails on, a route the nodes do not serve and generations past the deadline never
open a circuit breaker or count as node failures, while a node that fails what the
others answer still does. A 500 is tried on two nodes at most; a node's plain-text
error reaches the client as OpenAI-style JSON."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from support.stack import edge_settings, write_snapshot

pytestmark = pytest.mark.integration

CHAT = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}]}
#: 990 nested objects: valid JSON that makes a Python server answer 500 (RecursionError)
POISON = ('{"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "x": %s}'
          % ('{"a":' * 990 + "1" + "}" * 990))


def _pool(simnodes, redis_server, edge_factory, *, sim: dict | None = None, **edge: Any):
    """Three simnodes behind an edge that accepts deep JSON (so the poison reaches the
    nodes), on a fresh snapshot where all score 0: the breaker, not the local failure
    rate, keeps a failing node out."""
    nodes = simnodes(3, time_scale=0.05, **(sim or {}))
    opts = {"breaker_failures": 3, "breaker_cooldown_s": 30.0, "max_json_depth": 1000,
            "stale_after_s": 120.0, **edge}
    e = edge_factory(edge_settings(redis_server.url, [n.node_settings() for n in nodes], **opts))
    snap = write_snapshot(redis_server.client(), [n.snapshot_node(score=0.0) for n in nodes])
    e.wait_snapshot(snap["version"])
    return e, nodes


def _breakers(edge) -> dict[str, tuple[str, int]]:
    return {n["name"]: (n["breaker"], n["failures"]) for n in edge.status()["nodes"]}


def _poison(edge) -> requests.Response:
    return requests.post(f"{edge.url}/v1/chat/completions", data=POISON,
                         headers={"Content-Type": "application/json"}, timeout=30)


def test_a_body_every_node_fails_is_tried_twice_and_counts_against_none(
        simnodes, redis_server, edge_factory) -> None:
    edge, nodes = _pool(simnodes, redis_server, edge_factory)
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: _poison(edge), range(10)))
    for res in answers:
        assert res.status_code == 500, res.text
        assert res.headers["Content-Type"].startswith("application/json")
        err = res.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "upstream_error" and err["type"] == "server_error"
        assert "answered 500" in err["message"] and "Internal Server Error" in err["message"]
    assert sum(n.state()["requests_total"] for n in nodes) == 20, "each poison body: two nodes"
    assert all(v == ("closed", 0) for v in _breakers(edge).values()), _breakers(edge)
    # the pool still serves everyone
    for _ in range(6):
        assert requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_a_node_failing_what_the_others_answer_still_opens_its_breaker(
        simnodes, redis_server, edge_factory) -> None:
    edge, nodes = _pool(simnodes, redis_server, edge_factory)
    nodes[0].set_faults(error_rate=1.0)
    for _ in range(30):
        res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert res.status_code == 200, res.text
    state, failures = _breakers(edge)[nodes[0].name]
    assert state == "open" and failures == 3
    assert all(_breakers(edge)[n.name] == ("closed", 0) for n in nodes[1:])


def test_a_route_the_nodes_do_not_serve_is_not_a_failure(
        simnodes, redis_server, edge_factory) -> None:
    edge, nodes = _pool(simnodes, redis_server, edge_factory)
    for _ in range(12):
        res = requests.post(f"{edge.url}/v1/embeddings", json={"model": "sim-llama", "input": "x"},
                            timeout=30)
        assert res.status_code == 404 and res.json()["error"]
    assert sum(n.state()["by_path"].get("/v1/embeddings", 0) for n in nodes) == 12, "never retried"
    assert all(v == ("closed", 0) for v in _breakers(edge).values()), _breakers(edge)


def test_generations_past_the_deadline_open_no_breaker(simnodes, redis_server, edge_factory) -> None:
    nodes = simnodes(2, time_scale=1.0)  # 200 tokens take ~4 s
    s = edge_settings(redis_server.url, [n.node_settings() for n in nodes], breaker_failures=2,
                      breaker_cooldown_s=30.0)
    s.deadlines.request_ms = 700
    edge = edge_factory(s)
    body = {**CHAT, "sim_output_tokens": 200}
    t0 = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: requests.post(f"{edge.url}/v1/chat/completions",
                                                        json=body, timeout=30), range(6)))
    assert all(r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
               for r in answers), [r.text for r in answers]
    assert time.monotonic() - t0 < 5
    assert all(v == ("closed", 0) for v in _breakers(edge).values()), _breakers(edge)
    res = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "sim_output_tokens": 3},
                        timeout=30)
    assert res.status_code == 200


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "proxy"])
def test_an_answer_cut_short_of_its_length_is_a_failure_of_its_node(
        tiny_upstreams, redis_server, edge_factory, relay: bool) -> None:
    """A node that sends a 200 whose body ends before its Content-Length: relayed
    (edge.answer_relay), a plain request is answered by the other node, since nothing
    went to the client; on nginx's proxy path its client gets what plain nginx passes on
    (headers were sent: a short body and a closed connection). Either way the node is
    failed, not credited with a fast answer, and its breaker opens; a stream request is
    not passed on at all (the relay answers 502 when no other node is left)."""
    a, b = tiny_upstreams(names=["a", "b"])
    a.mode = "cut"
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      breaker_failures=3, breaker_cooldown_s=120.0,
                                      answer_relay=relay))
    cut = 0
    for _ in range(30):
        try:
            res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10)
        except requests.RequestException:
            cut += 1
            continue
        assert res.status_code == 200 and res.json()["choices"], res.text
    nodes = {n["name"]: n for n in edge.status()["nodes"]}
    if relay:
        assert cut == 0 and 1 <= a.hits <= 3, (cut, a.hits)
    else:
        assert 1 <= cut <= 3 and a.hits == cut, (cut, a.hits)
    assert nodes["a"]["failures"] >= a.hits
    assert nodes["a"]["breaker"] == "open" or a.hits < 3, nodes["a"]
    b.mode = "cut"
    res = requests.post(f"{edge.url}/v1/chat/completions", timeout=10,
                        json={**CHAT, "stream": True})
    assert res.status_code == 502, res.text
    assert "answer cut" in res.json()["error"]["message"]
