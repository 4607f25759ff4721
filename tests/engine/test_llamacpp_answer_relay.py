"""Two real llama.cpp servers (``llama-server``, Gemma 3 270M, one slot each) behind the
edge, requests that are not streams (edge.answer_relay, lua/infergate/stream/answer.lua):

- the server holding one is frozen (SIGSTOP: its kernel still accepts connections): the
  request is answered by the other server seconds later, not at its deadline;
- a client that leaves: llama-server goes on with the answer after the connection
  closed, and the edge keeps its slot counted until the server is done;
- past the deadline (the client has its 504): the same, and the next request goes to
  the idle server.

Answers are sized by the servers' measured decode speed, to outlast the client's wait
on a fast host too. llama-server drops an answer whose connection closed only after a
second with no result of any request on it (``server_response_reader::next``): the
deadline is off the whole second, and the /slots calls keep the server working.

Needs the binary of ``python -m bench.realnode build`` (see tests/support/realnode.py)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.realnode import MODEL_ALIAS
from bench.realnode.launch import CTX_PER_SLOT
from controlplane import procs
from support.stack import edge_settings, snapshot_node, write_snapshot

pytestmark = pytest.mark.integration

#: A long answer: EOS ignored, max_tokens generated (sized by :func:`_long`).
LONG = {"model": MODEL_ALIAS, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about lighthouses."}]}
#: Most tokens one answer may have: the slot's context (CTX_PER_SLOT) less the prompt.
MAX_ANSWER_TOKENS = CTX_PER_SLOT - 64


def _long(nodes, seconds: float) -> dict:
    """LONG with max_tokens for about ``seconds`` of generation on the faster of
    ``nodes``: its decode speed is measured first (llama-server's ``timings``,
    ``predicted_per_second``), so that the answer lasts on a fast host too."""
    speed = 0.0
    for node in nodes.values():
        res = requests.post(f"{node.url}/v1/chat/completions",
                            json={**LONG, "max_tokens": 48}, timeout=60)
        res.raise_for_status()
        speed = max(speed, float(res.json()["timings"]["predicted_per_second"]))
    return {**LONG, "max_tokens": min(MAX_ANSWER_TOKENS, int(speed * seconds) + 1)}


def _slots_busy(node) -> int:
    """Busy slots of a llama-server (GET /slots)."""
    return sum(1 for s in requests.get(f"{node.url}/slots", timeout=5).json()
               if s.get("is_processing"))


def _two_servers(realnodes, redis_server, edge_factory, request_ms: int | None = None):
    """Two one-slot llama-servers behind an edge that knows them as llama.cpp servers
    (slots_source "server"): (edge, {name: node})."""
    nodes = realnodes(2, parallel=1, threads=1)
    s = edge_settings(redis_server.url, [], stale_after_s=3600, read_timeout_ms=60000)
    if request_ms is not None:
        s.deadlines.request_ms = request_ms
    edge = edge_factory(s)
    snap = write_snapshot(redis_server.client(), [
        snapshot_node(f"cpp-{i}", "127.0.0.1", n.port, kind="openai", slots=1,
                      slots_source="server", max_concurrency=1, score=None, has_metrics=False)
        for i, n in enumerate(nodes)])
    edge.wait_snapshot(snap["version"])
    return edge, {f"cpp-{i}": n for i, n in enumerate(nodes)}


@pytest.fixture
def pair(realnodes, redis_server, edge_factory):
    return _two_servers(realnodes, redis_server, edge_factory)


def test_a_request_on_a_server_that_froze_is_answered_by_the_other(pair) -> None:
    edge, nodes = pair
    body = _long(nodes, 4.0)
    pool = ThreadPoolExecutor(1)
    frozen = None
    try:
        fut = pool.submit(requests.post, f"{edge.url}/v1/chat/completions", json=body,
                          timeout=60)
        procs.wait_until(lambda: any(_slots_busy(n) for n in nodes.values()), 20,
                         what="the answer to start")
        frozen = next(n for n in nodes.values() if _slots_busy(n))
        os.kill(frozen.managed.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        res = fut.result(timeout=60)
        took = time.monotonic() - t0
    finally:
        if frozen is not None:
            os.kill(frozen.managed.pid, signal.SIGCONT)
        pool.shutdown(wait=True)
    assert res.status_code == 200, res.text
    other = next(name for name, n in nodes.items() if n is not frozen)
    assert res.headers["X-Infergate-Node"] == other
    assert res.json()["usage"]["completion_tokens"] == body["max_tokens"]
    # found silent (1 s of quiet, a 1 s check, the finding's 3 s check), then the whole
    # answer on the other server; the deadline (30 s) is not waited for
    assert took < 25.0, took
    assert "no answer to a liveness check" in edge.error_log()


def test_a_client_that_leaves_keeps_the_slot_counted_while_the_server_works(pair) -> None:
    edge, nodes = pair
    body = _long(nodes, 5.0)  # well past the client's 1.5 s
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=1.5)
    busy = [name for name, n in nodes.items() if _slots_busy(n)]
    assert len(busy) == 1, "llama-server went on with the answer"
    name = busy[0]
    # while the server works, the edge counts its slot as taken (an answer just sent
    # may leave /slots busy a moment after the edge freed it)
    while _slots_busy(nodes[name]):
        if edge.node_status(name)["inflight"] != 1:
            procs.wait_until(lambda: not _slots_busy(nodes[name]), 1, what="the server done")
            break
        time.sleep(0.2)
    procs.wait_until(lambda: edge.node_status(name)["inflight"] == 0, 10, what="the slot freed")


@pytest.fixture
def short_deadline_pair(realnodes, redis_server, edge_factory):
    # off the whole second: at 3 s, llama-server's check of the connection (each second
    # from the answer's start) would come just as the edge closes it
    return _two_servers(realnodes, redis_server, edge_factory, request_ms=3500)


def test_past_its_deadline_the_slot_stays_counted_while_the_server_works(
        short_deadline_pair) -> None:
    edge, nodes = short_deadline_pair
    body = _long(nodes, 8.0)  # well past the 3.5 s deadline
    session = requests.Session()  # the next request comes on the same connection
    t0 = time.monotonic()
    res = session.post(f"{edge.url}/v1/chat/completions", json=body, timeout=30)
    assert res.status_code == 504, res.text
    assert res.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - t0 < 15.0  # at the deadline, not once the server is done
    busy = [name for name, n in nodes.items() if _slots_busy(n)]
    assert len(busy) == 1, "llama-server went on with the answer"
    name = busy[0]
    assert edge.node_status(name)["inflight"] == 1, "the slot the server still works in"
    # the next request goes to the idle server
    nxt = session.post(f"{edge.url}/v1/chat/completions", json={**LONG, "max_tokens": 4},
                       timeout=30)
    assert nxt.status_code == 200, nxt.text
    assert nxt.headers["X-Infergate-Node"] != name
    while _slots_busy(nodes[name]):
        if edge.node_status(name)["inflight"] != 1:
            procs.wait_until(lambda: not _slots_busy(nodes[name]), 1, what="the server done")
            break
        time.sleep(0.2)
    procs.wait_until(lambda: edge.node_status(name)["inflight"] == 0, 10, what="the slot freed")
