"""What the edge sees a real llama.cpp server (``llama-server``, Gemma 3 270M) run at once
(lua/infergate/routing/alongside.lua): a stream whose first token comes before any
earlier request on the server ended ran alongside them. llama-server sends a stream's
first chunk only once a slot runs it, so a one-slot server is never seen running two,
however many streams the edge keeps in flight there, and a two-slot server is seen
running two. The edge is not told the slots (a server of kind ``openai``, no metrics).
Needs the binary of ``python -m bench.realnode build`` (see tests/support/realnode.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.realnode import MODEL_ALIAS
from support.stack import edge_settings, snapshot_node, write_snapshot

pytestmark = pytest.mark.integration

STREAM = {"model": MODEL_ALIAS, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
          "stream": True, "messages": [{"role": "user", "content": "Name a colour."}]}


def _stream(edge) -> None:
    res = requests.post(f"{edge.url}/v1/chat/completions", json=STREAM, timeout=120)
    assert res.status_code == 200 and "[DONE]" in res.text, res.text


def _seen_at_once(edge, node, name: str, at_once: int, rounds: int, redis_server):
    snap = write_snapshot(redis_server.client(), [
        snapshot_node(name, "127.0.0.1", node.port, kind="openai", max_concurrency=4,
                      score=None, has_metrics=False)])
    edge.wait_snapshot(snap["version"])
    for _ in range(rounds):
        with ThreadPoolExecutor(at_once) as pool:
            list(pool.map(lambda _: _stream(edge), range(at_once)))
    return edge.node_status(name)["seen_at_once"]


def test_a_server_is_seen_running_what_its_slots_run(realnodes, redis_server,
                                                     edge_factory) -> None:
    one, = realnodes(1, parallel=1, threads=1)
    two, = realnodes(1, parallel=2, threads=1)
    edge = edge_factory(edge_settings(redis_server.url, [], stale_after_s=3600,
                                      read_timeout_ms=120000))
    assert _seen_at_once(edge, one, "one-slot", 3, 2, redis_server) is None
    assert _seen_at_once(edge, two, "two-slots", 2, 4, redis_server) == 2
