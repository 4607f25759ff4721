"""A real llama.cpp server (``llama-server``, Gemma 3 270M) with one slot behind the
control plane and the edge: the control plane reads the slot from ``/props`` into the
routing snapshot (``slots`` = 1, ``slots_source`` = ``server``), and more concurrent
streams than slots wait at the edge, not in the server's queue: every stream runs to its
end, none gets a 5xx, and the server's ``llamacpp:requests_deferred`` stays 0.
Needs the binary of ``python -m bench.realnode build`` (see tests/support/realnode.py)."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from bench.realnode import MODEL_ALIAS
from controlplane import procs
from controlplane.config import NodeSettings
from controlplane.redisdb import keynames
from support.stack import edge_settings

pytestmark = pytest.mark.integration

FINISHED = re.compile(r'"finish_reason":\s*"(stop|length)"')
DEFERRED = re.compile(r"^llamacpp:requests_deferred\s+([0-9.eE+-]+)", re.M)


def _deferred(url: str) -> float:
    try:
        m = DEFERRED.search(requests.get(url + "/metrics", timeout=2).text)
    except requests.RequestException:
        return 0.0
    return float(m.group(1)) if m else 0.0


def _snapshot_node(redis_url: str) -> dict | None:
    raw = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=2).get(
        keynames.ROUTING)
    nodes = json.loads(raw)["nodes"] if raw else []
    return nodes[0] if nodes else None


def test_streams_beyond_the_slot_wait_at_the_edge(realnodes, redis_server, controlplane_factory,
                                                  edge_factory) -> None:
    (node,) = realnodes(1, parallel=1, threads=1)
    s = edge_settings(redis_server.url, [NodeSettings(name="cpp", url=node.url)],
                      read_timeout_ms=120000)
    s.deadlines.request_ms = 120000
    s.controlplane.poll_interval_s = 0.5
    controlplane_factory(s)

    def detected() -> bool:
        n = _snapshot_node(redis_server.url)
        return bool(n and n["healthy"] and n.get("slots") == 1
                    and n.get("slots_source") == "server")

    procs.wait_until(detected, timeout=60, what="the node's slot read into the snapshot")
    edge = edge_factory(s)
    procs.wait_until(lambda: edge.node_status("cpp").get("healthy") is True, timeout=10,
                     what="the edge to have the snapshot")

    deferred_max = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            deferred_max[0] = max(deferred_max[0], _deferred(node.url))
            stop.wait(0.02)

    def stream(i: int) -> tuple[int, bool]:
        body = {"model": MODEL_ALIAS, "stream": True, "max_tokens": 16,
                "messages": [{"role": "user", "content": f"Count to ten ({i})."}]}
        with requests.post(f"{edge.url}/v1/chat/completions", json=body, stream=True,
                           timeout=120) as res:
            return res.status_code, FINISHED.search(res.text) is not None

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(stream, range(4)))
    finally:
        stop.set()
        sampler.join(5)
    assert [s for s, _ in got] == [200] * 4, got
    assert all(done for _, done in got), got          # no stream was cut
    assert deferred_max[0] == 0.0                     # nothing waited in the server
    assert edge.status()["admission"]["shed"] == 0


def test_a_prompt_far_over_the_slot_context_is_refused_at_the_edge(
        realnodes, redis_server, controlplane_factory, edge_factory) -> None:
    """The control plane reads the slot's context from ``/props`` into the snapshot; a
    prompt estimated at over twice it gets the edge's 400 ``context_length_exceeded`` at
    once and never reaches the node (which would tokenize it all first); a prompt below
    that goes to the node, whose own answer comes back."""
    (node,) = realnodes(1, parallel=1, threads=1)
    s = edge_settings(redis_server.url, [NodeSettings(name="cpp", url=node.url)],
                      read_timeout_ms=120000)
    s.deadlines.request_ms = 120000   # one thread reading ~1,000 tokens on a busy host
    s.controlplane.poll_interval_s = 0.5
    controlplane_factory(s)

    def detected() -> bool:
        n = _snapshot_node(redis_server.url)
        return bool(n and n["healthy"] and n.get("ctx_tokens"))

    procs.wait_until(detected, timeout=60, what="the slot context read into the snapshot")
    ctx = _snapshot_node(redis_server.url)["ctx_tokens"]
    props = requests.get(node.url + "/props", timeout=5).json()
    assert ctx == props["default_generation_settings"]["n_ctx"]
    edge = edge_factory(s)
    procs.wait_until(lambda: edge.node_status("cpp").get("healthy") is True, timeout=10,
                     what="the edge to have the snapshot")

    def prompt_tokens_total() -> float:
        m = re.search(r"^llamacpp:prompt_tokens_total\s+([0-9.eE+-]+)",
                      requests.get(node.url + "/metrics", timeout=5).text, re.M)
        return float(m.group(1)) if m else 0.0

    def ask(words: int) -> requests.Response:
        body = {"model": MODEL_ALIAS, "max_tokens": 2,
                "messages": [{"role": "user", "content": "lorem ipsum " * words}]}
        return requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=120)

    before = prompt_tokens_total()
    far = ask(ctx * 2)                                   # ~24 characters a pair: ~6x ctx
    assert far.status_code == 400, far.text
    err = far.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert str(ctx) in err["message"]
    near = ask(ctx // 6)                                 # ~0.5x ctx by the estimate
    assert near.status_code == 200, near.text
    assert prompt_tokens_total() > before                # only the second one was read
    assert prompt_tokens_total() - before < ctx
