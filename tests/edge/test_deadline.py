"""Deadlines at the edge (lua/infergate/admission/deadline.lua) with real nginx and simulated
nodes: a request past its deadline gets 504 deadline_exceeded, no new try starts and
the node sees the request cancelled; per-route deadlines; the stream idle timeout;
a client that disconnects (mid-stream or before the answer) makes the edge drop the
node's request at once, and the in-flight counters come back to zero."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import openai
import pytest
import requests

from controlplane import procs
from controlplane.config import RouteDeadlineSettings, Settings
from support.stack import edge_settings


def settings(redis_url: str, nodes: list, **deadlines: Any) -> Settings:
    s = edge_settings(redis_url, nodes)
    for k, v in deadlines.items():
        setattr(s.deadlines, k, v)
    return s


def chat(tokens: int, **kw: Any) -> dict:
    return {"model": "sim-llama", "sim_output_tokens": tokens,
            "messages": [{"role": "user", "content": "tell me a story"}], **kw}


def total(nodes: list, field: str) -> int:
    return sum(n.state()[field] for n in nodes)


def test_deadline_gives_504_and_cancels_the_node(redis_server, simnodes, edge_factory) -> None:
    nodes = simnodes(2)  # real time: 200 tokens take ~4 s
    s = settings(redis_server.url, [n.node_settings() for n in nodes], request_ms=20000,
                 routes={"/v1/chat/completions": RouteDeadlineSettings(request_ms=600)})
    edge = edge_factory(s)

    started = time.monotonic()
    res = requests.post(f"{edge.url}/v1/chat/completions", json=chat(200), timeout=15)
    elapsed = time.monotonic() - started
    assert res.status_code == 504, res.text
    assert res.headers["Content-Type"] == "application/json"
    err = res.json()["error"]
    assert err["type"] == "timeout" and err["code"] == "deadline_exceeded"
    assert "600 ms" in err["message"]
    assert 0.55 <= elapsed < 2.0, elapsed
    # the answer names the node that was still working when the deadline passed
    assert res.headers["X-Infergate-Node"] in {n.name for n in nodes}
    # one try only: the deadline had passed when nginx would have tried the other node
    assert total(nodes, "requests_total") == 1
    procs.wait_until(lambda: total(nodes, "cancelled_total") == 1 and total(nodes, "running") == 0,
                     5, what="the node to see the request cancelled")
    assert total(nodes, "completed_total") == 0
    assert edge.status()["admission"]["deadline_exceeded"] == 1
    # the answer tells the OpenAI SDKs not to retry (they retry a 5xx twice by default):
    # the client gets the 504 after one try, not after three deadlines
    assert res.headers["x-should-retry"] == "false"
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="none")
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model="sim-llama", extra_body={"sim_output_tokens": 200},
                                       messages=[{"role": "user", "content": "tell me a story"}])
    assert exc.value.status_code == 504
    assert total(nodes, "requests_total") == 2

    # another route keeps the global deadline: a short request completes
    res = requests.post(f"{edge.url}/v1/completions", timeout=15,
                        json={"model": "sim-llama", "prompt": "hi", "sim_output_tokens": 40})
    assert res.status_code == 200, res.text
    edge.wait_idle()


def test_deadline_passed_before_the_first_try(redis_server, simnodes, edge_factory) -> None:
    """Time spent at the edge counts: an admission wait longer than the deadline."""
    from support.stack import write_snapshot

    (node,) = simnodes(1)
    s = settings(redis_server.url, [node.node_settings()], request_ms=300)
    s.admission.max_wait_ms = 2000
    edge = edge_factory(s)
    r = redis_server.client()
    snap = write_snapshot(r, [node.snapshot_node(saturated=True)])
    edge.wait_snapshot(snap["version"])
    started = time.monotonic()
    res = requests.post(f"{edge.url}/v1/chat/completions", json=chat(5), timeout=15)
    # the wait stops at the deadline: shed with 429, never sent to the node
    assert res.status_code == 429, res.text
    assert time.monotonic() - started < 1.0
    assert node.state()["requests_total"] == 0


def test_stream_idle_timeout(redis_server, simnodes, edge_factory) -> None:
    (node,) = simnodes(1, "--hang")
    s = settings(redis_server.url, [node.node_settings()], request_ms=20000, stream_idle_ms=400)
    edge = edge_factory(s)
    started = time.monotonic()
    res = requests.post(f"{edge.url}/v1/chat/completions", json=chat(10, stream=True), timeout=15)
    elapsed = time.monotonic() - started
    assert res.status_code == 504, res.text
    assert res.json()["error"]["code"] == "upstream_timeout"  # silence, not the deadline
    assert res.headers["X-Infergate-Node"] == node.name  # the node that went silent
    assert 0.35 <= elapsed < 2.0, elapsed
    procs.wait_until(lambda: node.state()["cancelled_total"] == 1, 5, what="node-side cancel")


def test_every_gap_of_a_stream_is_cut_at_the_idle_time(redis_server, tiny_upstreams,
                                                       edge_factory) -> None:
    """A node that goes silent mid-stream for longer than stream_idle_ms, while it still
    answers the edge's liveness checks, is cut at that time after its last chunk, the
    first gap as any later one: the reads after content (2 x the stall threshold each)
    used to run past the bound, so a gap a little over it went through. The stream ends
    with an error event that names the idle limit."""
    (up,) = tiny_upstreams(1)
    up.chunks, up.chunk_interval_s = 3, 1.15
    s = edge_settings(redis_server.url, [up.node_settings()], stall_min_s=0.2,
                      stream_hold_s=0, read_timeout_ms=20000)
    s.deadlines.request_ms, s.deadlines.stream_idle_ms = 20000, 1000
    edge = edge_factory(s)
    started = time.monotonic()
    with requests.post(f"{edge.url}/v1/chat/completions", json=chat(3, stream=True),
                       stream=True, timeout=15) as res:
        assert res.status_code == 200
        events = [(time.monotonic() - started, ln) for ln in res.iter_lines() if ln]
    assert len(events) == 3, events      # the first chunk, the error event, [DONE]
    at, error = events[1]
    assert 0.9 < at < 1.12, events       # cut at the bound, before the next chunk (1.15 s)
    err = json.loads(error[len(b"data: "):])["error"]
    assert err["code"] == "stream_interrupted" and "stream idle limit" in err["message"], err


def test_streams_are_not_cut_by_the_request_deadline(redis_server, simnodes, edge_factory) -> None:
    (node,) = simnodes(1)  # real time: ~21 ms between chunks, ~0.9 s in all
    s = settings(redis_server.url, [node.node_settings()], request_ms=300, stream_idle_ms=2000)
    edge = edge_factory(s)
    started = time.monotonic()
    with requests.post(f"{edge.url}/v1/chat/completions", json=chat(40, stream=True),
                       stream=True, timeout=15) as res:
        assert res.status_code == 200
        text = b"".join(res.iter_content(None)).decode()
    assert time.monotonic() - started > 0.3
    assert text.rstrip().endswith("data: [DONE]")
    assert node.state()["completed_total"] == 1


def raw_request(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_client_disconnect_mid_stream_cancels_the_node(redis_server, simnodes, edge_factory) -> None:
    (node,) = simnodes(1)  # real time: ~20 ms per token, 300 tokens ~ 6 s
    edge = edge_factory(settings(redis_server.url, [node.node_settings()]))
    sock = raw_request(edge.url, chat(300, stream=True))
    got = b""
    while got.count(b"data: ") < 3:
        chunk = sock.recv(65536)
        assert chunk, "stream ended early"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200")
    assert edge.status()["inflight_total"] == 1
    sock.close()
    started = time.monotonic()
    procs.wait_until(lambda: node.state()["cancelled_total"] == 1, 5, what="node-side cancel")
    assert time.monotonic() - started < 2.0
    st = node.state()
    assert st["running"] == 0 and st["completed_total"] == 0
    edge.wait_idle(timeout=5)


def test_client_disconnect_before_the_answer_cancels_the_node(redis_server, simnodes, edge_factory) -> None:
    (node,) = simnodes(1)
    edge = edge_factory(settings(redis_server.url, [node.node_settings()]))
    sock = raw_request(edge.url, chat(300))
    procs.wait_until(lambda: node.state()["running"] == 1, 5, what="the node to run the request")
    sock.close()
    procs.wait_until(lambda: node.state()["cancelled_total"] == 1, 5, what="node-side cancel")
    assert node.state()["completed_total"] == 0
    edge.wait_idle(timeout=5)
    assert " 499 " in edge.access_log()


def test_a_connect_timeout_is_the_nodes_fault_not_the_deadlines(redis_server, edge_factory) -> None:
    # A node whose accept queue is full: the kernel drops the edge's SYNs, so connecting
    # times out (connect_timeout_ms) long before the deadline, which bounds the read.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    fillers = []
    try:
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(lsock.getsockname())
            fillers.append(c)
        port = lsock.getsockname()[1]
        s = edge_settings(redis_server.url, [{"name": "deaf", "url": f"http://127.0.0.1:{port}"}],
                          connect_timeout_ms=300, read_timeout_ms=60000)
        s.deadlines.request_ms = 20000
        edge = edge_factory(s)
        started = time.monotonic()
        res = requests.post(f"{edge.url}/v1/chat/completions", json=chat(5), timeout=15)
        elapsed = time.monotonic() - started
        assert res.status_code == 504, res.text
        assert res.json()["error"]["code"] == "upstream_timeout"
        assert elapsed < 5, elapsed
        st = edge.node_status("deaf")
        assert st["failures"] >= 1 and st["consecutive_failures"] >= 1, st
        assert edge.status()["admission"]["deadline_exceeded"] == 0
    finally:
        for c in fillers:
            c.close()
        lsock.close()


def test_a_stream_whose_node_never_answers_gets_504_at_the_deadline(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """The stream idle time bounds a stream's reads, but while nothing has gone to the
    client the wait for the node's answer to begin ends at the request's deadline: a
    frozen node (connection accepted, nothing sent) gives 504 deadline_exceeded at
    request_ms, not after the stream idle time."""
    (node,) = tiny_upstreams(names=["frozen"])
    node.mode = "hang"
    s = settings(redis_server.url, [node.node_settings()], request_ms=1500, stream_idle_ms=20000)
    edge = edge_factory(s)
    started = time.monotonic()
    try:
        res = requests.post(f"{edge.url}/v1/chat/completions", json=chat(8, stream=True),
                            timeout=30)
        took = time.monotonic() - started
    finally:
        node.release()
    assert res.status_code == 504, res.text
    assert res.json()["error"]["code"] == "deadline_exceeded"
    assert res.headers["x-should-retry"] == "false"
    assert 1.4 < took < 10, took


def test_the_clients_own_timeout_shortens_the_deadline(redis_server, simnodes, edge_factory) -> None:
    """A client that says its timeout (``X-Request-Timeout``, the OpenAI SDKs'
    ``X-Stainless-Read-Timeout`` / ``X-Stainless-Timeout``) gets its 504 within it, a
    tenth of it (at most 1 s) early, not at the route's longer deadline it would have
    given up before; a longer timeout, and values that are not a timeout, leave the
    route's deadline; an OpenAI SDK client with ``timeout=1.5`` gets the 504 too."""
    (node,) = simnodes(1)                      # real time: 200 tokens take ~4 s
    edge = edge_factory(settings(redis_server.url, [node.node_settings()], request_ms=20000))
    url = f"{edge.url}/v1/chat/completions"

    def deadline_of(headers: dict) -> str:
        res = requests.post(url, json=chat(200), headers=headers, timeout=30)
        assert res.status_code == 504, res.text
        return res.json()["error"]["message"]

    assert "deadline of 900 ms (the timeout the client sent" in deadline_of(
        {"X-Request-Timeout": "1"})
    assert "deadline of 1350 ms" in deadline_of({"X-Stainless-Read-Timeout": "1.5"})
    assert "deadline of 1800 ms" in deadline_of({"X-Stainless-Timeout": "2",
                                                 "X-Request-Timeout": "30"})
    # a timeout longer than the route's deadline, or no timeout, changes nothing
    for headers in ({"X-Stainless-Read-Timeout": "600"}, {"X-Request-Timeout": "abc"},
                    {"X-Request-Timeout": "0"}, {"X-Request-Timeout": "-5"},
                    {"X-Request-Timeout": "nan"}, {"X-Request-Timeout": "0x1"},
                    {"X-Request-Timeout": "1e0"}, {"X-Request-Timeout": "inf"}):
        res = requests.post(url, json=chat(4), headers=headers, timeout=30)
        assert res.status_code == 200, (headers, res.text)
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="x", timeout=1.5, max_retries=0)
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="sim-llama", max_tokens=200,
                                       messages=[{"role": "user", "content": "tell me a story"}],
                                       extra_body={"sim_output_tokens": 200})
    assert exc.value.status_code == 504 and "deadline of 1350 ms" in str(exc.value)
