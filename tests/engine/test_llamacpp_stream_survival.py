"""Two real llama.cpp servers (``llama-server``, Gemma 3 270M, one slot each) behind the
edge: the server a greedy stream runs on is killed (SIGKILL) after a few tokens, and the
client still gets one well-formed stream (one id, one finish_reason, one [DONE], no
error): the edge continued the answer on the other server with the partial text as an
assistant prefill (llama.cpp continues a last assistant message with a Jinja chat
template: tools/server/server-common.cpp, oaicompat_chat_params_parse; docs/streams.md
says what the seam looked like). Needs the
binary of ``python -m bench.realnode build`` (see tests/support/realnode.py)."""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest
import requests

from bench.realnode import MODEL_ALIAS
from controlplane import procs
from support.stack import edge_settings, snapshot_node, write_snapshot

pytestmark = pytest.mark.integration

BODY = {"model": MODEL_ALIAS, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "Write a short story about a lighthouse."}]}
#: Content chunks the client gets before the server is killed.
KILL_AFTER = 4


def test_a_stream_whose_server_is_killed_is_continued_on_the_other(
        realnodes, redis_server, edge_factory) -> None:
    nodes = realnodes(2, parallel=1, threads=1)
    by_name = {f"cpp-{i}": n for i, n in enumerate(nodes)}
    edge = edge_factory(edge_settings(redis_server.url, [], stale_after_s=3600,
                                      read_timeout_ms=60000))
    snap = write_snapshot(redis_server.client(), [
        snapshot_node(name, "127.0.0.1", n.port, kind="openai", slots=1, slots_source="server",
                      max_concurrency=1, score=None, has_metrics=False)
        for name, n in by_name.items()])
    edge.wait_snapshot(snap["version"])
    reference = requests.post(f"{nodes[0].url}/v1/chat/completions", json=BODY,
                              timeout=120).json()["choices"][0]["message"]["content"]

    events, pieces = [], []
    with requests.post(f"{edge.url}/v1/chat/completions", json={**BODY, "stream": True},
                       stream=True, timeout=120) as res:
        assert res.status_code == 200
        first = res.headers["X-Infergate-Node"]
        for line in res.iter_lines():
            if not line.startswith(b"data: "):
                continue
            events.append(line[len(b"data: "):].decode())
            if events[-1] == "[DONE]":
                continue
            delta = (json.loads(events[-1]).get("choices") or [{}])[0].get("delta", {})
            if delta.get("content"):
                pieces.append(delta["content"])
                if len(pieces) == KILL_AFTER:
                    by_name[first].managed.signal(signal.SIGKILL)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert len({c["id"] for c in chunks}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks
                if c.get("choices") and c["choices"][0].get("finish_reason")]
    assert len(finishes) == 1
    assert len(pieces) > KILL_AFTER, "the other server continued the answer"
    text = "".join(pieces)
    seam = "".join(pieces[:KILL_AFTER])
    same = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b),
                min(len(text), len(reference)))
    print(f"\nseam after {seam!r}: continued {''.join(pieces[KILL_AFTER:KILL_AFTER + 6])!r}; the first {same} "
          f"characters as without the kill (seam at {len(seam)}; {len(text)} and "
          f"{len(reference)} in all)\nspliced:   {text!r}\nreference: {reference!r}")
    assert text.startswith(seam)
    assert not text[len(seam):].startswith(seam), "the prefill the server repeats is taken out"
    (survivor,) = [n for name, n in by_name.items() if name != first]
    _abort_frees_the_slot(edge, survivor)


PROCESSING = re.compile(r"^llamacpp:requests_processing\s+([0-9.eE+-]+)", re.M)


def _processing(node) -> float:
    m = PROCESSING.search(requests.get(node.url + "/metrics", timeout=2).text)
    return float(m.group(1)) if m else -1.0


def _abort_frees_the_slot(edge, node) -> None:
    """A client that leaves a stream after 3 tokens: the server's slot is free again
    (llamacpp:requests_processing back to 0) at once."""
    host, port = edge.url.removeprefix("http://").split(":")
    body = json.dumps({**BODY, "stream": True, "max_tokens": 400}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        got = b""
        while got.count(b'"content":"') < 3:
            got += s.recv(65536)
        assert _processing(node) == 1
    left = time.monotonic()
    procs.wait_until(lambda: _processing(node) == 0, 5, interval=0.02,
                     what="the server's slot to be free")
    print(f"slot free {time.monotonic() - left:.3f} s after the client left")
