"""The whole stack: simulated vLLM nodes (``infergate simnode``), the control plane
(``infergate controlplane``, polling and writing snapshots to Redis) and the nginx
edge. Shares follow queue depth, faults are ridden over, drains are honoured, and a
dead pool answers JSON errors."""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from controlplane import procs
from controlplane.routing import registry
from controlplane.config import settings_from_dict

CHAT = {"model": "sim-llama", "messages": [{"role": "user", "content": "hello there"}],
        "sim_output_tokens": 4}


def _shares(edge, n: int, workers: int = 4, **body) -> Counter:
    def one(_: int) -> str:
        res = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, **body}, timeout=30)
        assert res.status_code == 200, res.text
        assert res.json()["system_fingerprint"] == res.headers["X-Infergate-Node"]
        return res.headers["X-Infergate-Node"]

    with ThreadPoolExecutor(workers) as pool:
        return Counter(pool.map(one, range(n)))


@pytest.fixture
def stack(simnodes, redis_server, controlplane_factory, edge_factory):
    """make(nodes, **edge) -> (edge, nodes, control plane): waits until the edge routes
    on a control-plane snapshot where every node has metrics."""
    def make(nodes, **edge):
        data = {
            "redis": {"url": redis_server.url},
            "edge": {"workers": 1, "sync_interval_s": 0.1, "stale_after_s": 5.0,
                     "connect_timeout_ms": 1000, "read_timeout_ms": 10000,
                     "breaker_failures": 3, "breaker_cooldown_s": 1.0, **edge},
            "controlplane": {"poll_interval_s": 0.25, "poll_timeout_s": 0.5,
                             "unhealthy_after": 2, "healthy_after": 1},
            "nodes": [n.node_settings(kind="vllm").model_dump() for n in nodes],
        }
        settings = settings_from_dict(data)
        cp = controlplane_factory(settings)
        e = edge_factory(settings)

        def ready() -> bool:
            st = e.status()
            return (st["snapshot"]["source"] == "redis" and len(st["nodes"]) == len(nodes)
                    and all(n["score"] is not None and n["eligible"] for n in st["nodes"]))

        procs.wait_until(ready, 20, what="edge routing on a full control-plane snapshot")
        return e, nodes, cp
    return make


def test_node_with_a_deep_queue_gets_a_clearly_smaller_share(stack, simnodes) -> None:
    busy, *idle = simnodes(3, names=["sim-busy", "sim-b", "sim-c"],
                           node_flags={"sim-busy": ["--max-running", "1"]})
    edge, _, _ = stack([busy, *idle])
    # keep the busy node's single slot taken, with a queue behind it
    direct = ThreadPoolExecutor(6)
    for _ in range(6):
        direct.submit(requests.post, f"{busy.url}/v1/chat/completions",
                      json={**CHAT, "sim_output_tokens": 150}, timeout=60)
    try:
        procs.wait_until(lambda: busy.state()["waiting"] >= 4, 10, what="queue on sim-busy")
        procs.wait_until(lambda: edge.node_status("sim-busy")["score"] >
                         max(edge.node_status(n.name)["score"] for n in idle) + 0.05,
                         10, what="control plane scoring the queue")
        shares = _shares(edge, 40)
        assert shares["sim-busy"] <= 4, shares
        assert shares["sim-b"] >= 12 and shares["sim-c"] >= 12, shares
    finally:
        # the direct requests still running end when the node stops at teardown
        direct.shutdown(wait=False, cancel_futures=True)


def test_faulty_nodes_are_ridden_over_and_come_back(stack, simnodes) -> None:
    nodes = simnodes(3, names=["sim-a", "sim-b", "sim-c"])
    edge, (a, b, c), _ = stack(nodes, read_timeout_ms=600)
    b.set_faults(error_rate=1.0)
    c.set_faults(hang=True)
    # until both breakers open, a request whose first node answers 500 goes to one more
    # node only (retries of a 500 stop at the second node, so a poison body cannot take
    # every node away): when that second node is the hanging one, the client gets the 504
    statuses = []

    def breakers_open() -> bool:
        statuses.append(requests.post(f"{edge.url}/v1/chat/completions", json=CHAT,
                                      timeout=30).status_code)
        return all(edge.node_status(n)["breaker"] in ("open", "half_open")
                   for n in ("sim-b", "sim-c"))

    procs.wait_until(breakers_open, 30, interval=0.05, what="sim-b and sim-c breakers open")
    assert set(statuses) <= {200, 500, 504}, statuses
    shares = _shares(edge, 24, workers=2)
    assert set(shares) == {"sim-a"}, shares
    st_b, st_c = edge.node_status("sim-b"), edge.node_status("sim-c")
    assert st_b["breaker"] in ("open", "half_open") and st_b["failures"] >= 3
    assert st_c["breaker"] in ("open", "half_open") and st_c["failures"] >= 1
    # recovery: after the cooldown a probe goes through and both serve again
    b.set_faults(error_rate=0.0)
    c.set_faults(hang=False)
    procs.wait_until(lambda: {"sim-b", "sim-c"} <= set(_shares(edge, 12, workers=3)), 20,
                     interval=0.3, what="sim-b and sim-c serving again")
    assert edge.node_status("sim-b")["breaker"] == "closed"


def test_drained_node_finishes_its_stream_and_gets_nothing_new(stack, simnodes, redis_server) -> None:
    nodes = simnodes(2, names=["sim-a", "sim-b"], time_scale=0.5)
    edge, (a, b), _ = stack(nodes)
    r = redis_server.client()
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="x", max_retries=0, timeout=30)
    # a long stream, then drain whichever node serves it
    raw = client.chat.completions.with_raw_response.create(
        model="sim-llama", messages=CHAT["messages"], stream=True,
        extra_body={"sim_output_tokens": 60})
    node = raw.headers["x-infergate-node"]
    other = "sim-b" if node == "sim-a" else "sim-a"
    stream = raw.parse()
    pieces: list[str] = []
    finish: list = []

    def read() -> None:
        for chunk in stream:
            if chunk.choices:
                if chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.choices[0].finish_reason:
                    finish.append(chunk.choices[0].finish_reason)

    t = threading.Thread(target=read)
    t.start()
    registry.set_state(r, node, "draining", actor="test")
    procs.wait_until(lambda: edge.node_status(node)["state"] == "draining", 10, what="drain seen")
    assert edge.node_status(node)["inflight"] == 1
    assert set(_shares(edge, 10, workers=2)) == {other}
    t.join(30)
    assert finish == ["length"] or finish == ["stop"], finish
    assert len(pieces) == 60
    procs.wait_until(lambda: edge.node_status(node)["inflight"] == 0, 5)
    # the control plane sees no in-flight request left and marks it drained
    procs.wait_until(lambda: registry.get_state(r, node).state == "drained", 20, what="drained")


def test_dead_pool_answers_json_errors(stack, simnodes) -> None:
    nodes = simnodes(2, names=["sim-a", "sim-b"])
    edge, (a, b), _ = stack(nodes, breaker_failures=100)
    for n in nodes:
        n.set_faults(refuse=True)
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert res.status_code == 502 and res.headers["Content-Type"] == "application/json"
    assert res.json()["error"]["type"] == "bad_gateway"
    # the control plane notices (health polls fail): 503 without trying any node
    procs.wait_until(lambda: not any(n["healthy"] for n in edge.status()["nodes"]), 15,
                     what="nodes marked unhealthy")
    before = sum(n["requests"] for n in edge.status()["nodes"])
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert res.status_code == 503 and res.json()["error"]["code"] == "no_healthy_upstream"
    assert sum(n["requests"] for n in edge.status()["nodes"]) == before
    # back: health returns, traffic flows
    for n in nodes:
        n.set_faults(refuse=False)
    procs.wait_until(lambda: all(n["eligible"] for n in edge.status()["nodes"]), 15, what="healthy again")
    assert sum(_shares(edge, 6).values()) == 6
    assert json.loads(requests.get(f"{edge.url}/v1/models", timeout=10).text)["data"][0]["id"] == "sim-llama"
