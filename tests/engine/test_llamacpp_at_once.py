"""What the edge sees a real llama.cpp server (``llama-server``, Gemma 3 270M) run at once
(lua/infergate/routing/alongside.lua): a stream that started while others ran there and
got its first token before any of them ended ran alongside them. Streams are sent one
after another, each once the one before has its first token (so the earlier ones run
when the next starts). llama-server sends a stream's first chunk only once a slot runs
it, so a one-slot server is never seen running two, and with its streams waiting for the
slot the edge takes it to run one at once although ``max_concurrency`` says 4; a
three-slot server sent four this way is seen running three, never four. Four sent at the
same moment say nothing (none runs yet when the others start: the fourth may reach the
server first). The edge is not told the slots (kind ``openai``, no metrics).
Needs the binary of ``python -m bench.realnode build`` (see tests/support/realnode.py)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.realnode import MODEL_ALIAS
from support.stack import edge_settings, snapshot_node, write_snapshot

pytestmark = pytest.mark.integration

STREAM = {"model": MODEL_ALIAS, "ignore_eos": True, "temperature": 0, "stream": True,
          "messages": [{"role": "user", "content": "Name a colour."}]}


def _stream(edge, max_tokens: int, first: threading.Event) -> None:
    with requests.post(f"{edge.url}/v1/chat/completions", stream=True, timeout=120,
                       json={**STREAM, "max_tokens": max_tokens}) as res:
        assert res.status_code == 200, res.text
        text = b""
        for chunk in res.iter_content(None):
            first.set()
            text += chunk
    assert b"[DONE]" in text


def _rounds(edge, node, name: str, lengths: tuple[int, ...], rounds: int, redis_server):
    """``rounds`` times: one stream per length, each sent once the one before has its
    first chunk; returns the node's status."""
    snap = write_snapshot(redis_server.client(), [
        snapshot_node(name, "127.0.0.1", node.port, kind="openai", max_concurrency=4,
                      score=0.1, has_metrics=True)])
    edge.wait_snapshot(snap["version"])
    for _ in range(rounds):
        with ThreadPoolExecutor(len(lengths)) as pool:
            futures = []
            for n in lengths:
                first = threading.Event()
                futures.append(pool.submit(_stream, edge, n, first))
                while not first.wait(0.05):
                    if futures[-1].done():
                        futures[-1].result()
            for f in futures:
                f.result()
    return edge.node_status(name)


def test_a_server_is_seen_running_what_its_slots_run(realnodes, redis_server,
                                                     edge_factory) -> None:
    one, = realnodes(1, parallel=1, threads=1)
    three, = realnodes(1, parallel=3, threads=1)
    edge = edge_factory(edge_settings(redis_server.url, [], stale_after_s=3600,
                                      read_timeout_ms=120000))
    st = _rounds(edge, one, "one-slot", (16, 16, 16), 4, redis_server)
    assert st["seen_at_once"] is None
    assert st["at_once"] == 1, st        # 8 streams in a row waited for the slot
    st = _rounds(edge, three, "three-slots", (30, 30, 30, 3), 3, redis_server)
    assert st["seen_at_once"] == 3, st
