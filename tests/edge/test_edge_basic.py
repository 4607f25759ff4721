"""The edge in front of small real HTTP upstreams, on the static node list of the
rendered config (no routing snapshot in Redis): answers, streams, the OpenAI SDK,
the X-Infergate-Node header, the status endpoint and JSON errors for bad input."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time

import openai
import pytest
import requests

from controlplane import procs
from support.stack import edge_settings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _assert_openai_error(res: requests.Response, status: int, code: str | None = None,
                         etype: str | None = None) -> dict:
    assert res.status_code == status, res.text
    assert res.headers["Content-Type"].startswith("application/json")
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] is None and err["message"]
    if code:
        assert err["code"] == code
    if etype:
        assert err["type"] == etype
    return err


@pytest.fixture
def two_nodes(tiny_upstreams, redis_server, edge_factory):
    ups = tiny_upstreams(names=["n1", "n2"])
    edge = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups],
                                      client_max_body_size="4k"))
    return edge, ups


def test_non_streaming_requests_are_spread_and_named(two_nodes) -> None:
    edge, ups = two_nodes
    seen = {}
    for _ in range(30):
        res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert res.status_code == 200
        node = res.headers["X-Infergate-Node"]
        assert res.json()["system_fingerprint"] == node == res.headers["X-Sim-Node"]
        seen[node] = seen.get(node, 0) + 1
    assert set(seen) == {"n1", "n2"}
    assert sum(u.hits for u in ups) == 30
    st = edge.status()
    assert st["snapshot"]["source"] == "static" and st["snapshot"]["stale"] is False
    assert {n["name"]: n["requests"] for n in st["nodes"]} == seen
    assert all(n["inflight"] == 0 and n["breaker"] == "closed" for n in st["nodes"])


def test_body_reaches_the_node_unchanged(two_nodes) -> None:
    edge, ups = two_nodes
    body = json.dumps({**CHAT, "extra": "ü" * 10}).encode()
    res = requests.post(f"{edge.url}/v1/completions", data=body,
                        headers={"Content-Type": "application/json"}, timeout=10)
    assert res.status_code == 200
    assert body in ups[0].bodies + ups[1].bodies


def test_stream_arrives_chunk_by_chunk(two_nodes) -> None:
    edge, ups = two_nodes
    for u in ups:
        u.chunks, u.chunk_interval_s = 6, 0.25
    t0 = time.monotonic()
    arrivals = []
    with requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                       stream=True, timeout=10) as res:
        assert res.status_code == 200
        assert res.headers["Content-Type"].startswith("text/event-stream")
        assert res.headers["X-Infergate-Node"] in ("n1", "n2")
        text = b""
        for chunk in res.iter_content(chunk_size=None):
            arrivals.append(time.monotonic() - t0)
            text += chunk
    events = [line for line in text.decode().splitlines() if line.startswith("data: ")]
    assert len(events) == 7 and events[-1] == "data: [DONE]"
    # first event long before the last one: nothing was buffered until the end
    assert arrivals[0] < 0.6, arrivals
    assert arrivals[-1] - arrivals[0] > 1.0, arrivals
    assert len(arrivals) >= 4


def test_openai_sdk_through_the_edge(two_nodes) -> None:
    edge, _ = two_nodes
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="unused", max_retries=0, timeout=10)
    out = client.chat.completions.create(model="tiny", messages=CHAT["messages"])
    assert out.choices[0].message.content.startswith("hello from n")
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=CHAT["messages"])
    assert raw.headers["x-infergate-node"] in ("n1", "n2")
    pieces = [c.choices[0].delta.content for c in
              client.chat.completions.create(model="tiny", messages=CHAT["messages"], stream=True)
              if c.choices and c.choices[0].delta.content]
    assert pieces == [f"tok{i} " for i in range(5)]
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    emb = client.embeddings.create(model="tiny", input="hello")
    assert emb.data[0].embedding == [0.1, 0.2]


def test_bad_json_gets_400_without_touching_nodes(two_nodes) -> None:
    edge, ups = two_nodes
    url = f"{edge.url}/v1/chat/completions"
    for body in (b"{not json", b"[1, 2]", b"", b"   ", b'"text"', b"{\"a\": 1} trailing"):
        res = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=10)
        _assert_openai_error(res, 400, etype="invalid_request_error")
    bom = requests.post(url, data=b"\xef\xbb\xbf" + json.dumps({"model": "m", "messages": []}).encode(),
                        headers={"Content-Type": "application/json"}, timeout=10)
    _assert_openai_error(bom, 400, etype="invalid_request_error")
    assert "byte order mark" in bom.json()["error"]["message"]
    assert sum(u.hits for u in ups) == 0


def test_unknown_paths_and_methods(two_nodes) -> None:
    edge, ups = two_nodes
    for path in ("/", "/nope", "/v2/chat/completions", "/v1"):
        res = requests.get(f"{edge.url}{path}", timeout=10, allow_redirects=False)
        _assert_openai_error(res, 404, code="not_found")
        assert "X-Request-Id" not in res.headers, (path, res.headers)
        # readable in curl's output: "/" is not escaped
        assert "under /v1 (/v1/chat/completions" in res.text and "\\/" not in res.text
    # a POST to "/v1" (no slash) too: no HTML 301 that a client would follow as a GET
    _assert_openai_error(requests.post(f"{edge.url}/v1", json={}, timeout=10,
                                       allow_redirects=False), 404, code="not_found")
    # any other /v1 path goes to a node, whose own 404 comes back with the request id
    for path in ("/v1/nope", "/v1/chat/completions/"):
        res = requests.get(f"{edge.url}{path}", timeout=10)
        _assert_openai_error(res, 404)
        assert res.headers["X-Infergate-Node"] in ("n1", "n2"), (path, res.headers)
        assert "X-Request-Id" in res.headers, (path, res.headers)
    # a /v1 path as nginx routes it, written otherwise
    host, port = edge.url.split("//", 1)[1].split(":")
    for path in ("//v1/nope", "/./v1/nope"):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", path)
        res = conn.getresponse()
        assert res.status == 404 and res.getheader("X-Request-Id"), (path, res.getheaders())
        assert res.getheader("X-Infergate-Node") in ("n1", "n2"), (path, res.getheaders())
        conn.close()
    res = requests.get(f"{edge.url}/v1/chat/completions", timeout=10)
    _assert_openai_error(res, 405, code="method_not_allowed")
    assert res.headers["Allow"] == "POST"
    res = requests.post(f"{edge.url}/v1/models", json={}, timeout=10)
    _assert_openai_error(res, 405)
    assert "GET" in res.headers["Allow"]
    res = requests.delete(f"{edge.url}/infergate/status", timeout=10)
    _assert_openai_error(res, 405)
    assert sum(u.hits for u in ups) == 0


def test_body_over_the_limit_gets_413(two_nodes) -> None:
    edge, ups = two_nodes
    big = json.dumps({**CHAT, "pad": "x" * 5000}).encode()
    res = requests.post(f"{edge.url}/v1/chat/completions", data=big,
                        headers={"Content-Type": "application/json"}, timeout=10)
    err = _assert_openai_error(res, 413, code="request_too_large")
    assert "4k" in err["message"]
    assert len(res.headers["X-Request-Id"]) == 32

    def chunked():
        yield big[:3000]
        yield big[3000:]

    res = requests.post(f"{edge.url}/v1/chat/completions", data=chunked(),
                        headers={"Content-Type": "application/json"}, timeout=10)
    _assert_openai_error(res, 413, code="request_too_large")
    assert sum(u.hits for u in ups) == 0


def test_chunked_body_under_the_limit_is_validated_and_sent(two_nodes) -> None:
    edge, ups = two_nodes
    body = json.dumps(CHAT).encode()

    def chunked():
        yield body[:10]
        yield body[10:]

    res = requests.post(f"{edge.url}/v1/chat/completions", data=chunked(), timeout=10)
    assert res.status_code == 200
    res = requests.post(f"{edge.url}/v1/chat/completions", data=(b for b in [b"{oops", b"}"]), timeout=10)
    _assert_openai_error(res, 400)
    assert sum(u.hits for u in ups) == 1


def test_status_endpoint_is_local_only(two_nodes) -> None:
    edge, _ = two_nodes
    st = edge.status()
    assert set(st) >= {"edge_id", "snapshot", "nodes", "inflight_total"}
    assert set(st["snapshot"]) >= {"source", "version", "age_s", "stale", "redis_ok"}
    node = st["nodes"][0]
    assert set(node) >= {"name", "inflight", "breaker", "latency_ewma_ms", "requests", "failures"}
    host, port = edge.url.removeprefix("http://").split(":")
    try:
        s = socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
    except OSError:
        pytest.skip("cannot bind 127.0.0.2 as a source address here")
    with s:
        s.sendall(b"GET /infergate/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403")
    assert b"application/json" in head and b'"code":"forbidden"' in body


def test_no_nodes_at_all_gets_503(tiny_upstreams, redis_server, edge_factory) -> None:
    edge = edge_factory(edge_settings(redis_server.url, []))
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10)
    _assert_openai_error(res, 503, code="no_healthy_upstream", etype="service_unavailable")
    assert res.headers["Retry-After"] == "1"  # admission.retry_after_s
    models = requests.get(f"{edge.url}/v1/models", timeout=10)
    _assert_openai_error(models, 503)
    assert models.headers["Retry-After"] == "1"
    assert edge.status()["nodes"] == []


def test_teardown_log_check_catches_bad_lines(two_nodes) -> None:
    """The edge fixture's error-log check (run after every edge test) really fires."""
    edge, _ = two_nodes
    assert edge.bad_log_lines() == []
    clean = edge.error_log()
    with open(edge.rendered.error_log, "a") as f:
        f.write("2026/01/01 00:00:00 [warn] 1#1: *1 [lua] x.lua:1: writing a global Lua variable ('x')\n"
                "2026/01/01 00:00:00 [crit] 1#1: *2 something bad\n")
    try:
        assert len(edge.bad_log_lines()) == 2
    finally:
        edge.rendered.error_log.write_text(clean)


def test_every_answer_carries_a_request_id(two_nodes) -> None:
    """X-Request-Id: 32 hex digits, the same the node got and the access log shows, which
    the OpenAI SDK reports as the request id; a new one per request."""
    edge, ups = two_nodes
    url = f"{edge.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "id please"}]}
    ids = []
    for _ in range(40):
        res = requests.post(url, json=body, timeout=10)
        assert res.status_code == 200
        ids.append(res.headers.get("X-Request-Id", ""))
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    assert set(ids) <= {i for u in ups for i in u.request_ids}, "the node got another id"
    # a request's access-log line is written in its log phase, after the answer went out
    def logged() -> bool:
        log = edge.rendered.access_log.read_text()
        return all(f"rid={i}" in log for i in ids)
    procs.wait_until(logged, timeout=10, what="every request id in the access log")
    edge.status()  # a location without a request id of the edge's own: no warning either
    assert "uninitialized" not in edge.rendered.error_log.read_text()
    bad = requests.post(url, data=b"{nope", headers={"Content-Type": "application/json"}, timeout=10)
    assert bad.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", bad.headers.get("X-Request-Id", ""))


def test_a_relayed_stream_passes_the_clients_headers_on(two_nodes) -> None:
    """A streamed request the edge relays itself reaches the node with the client's own
    headers, as nginx's proxy passes them, but the node's API key, the request id and
    the loop guard are the edge's, and the answer comes uncompressed (the relay reads it)."""
    edge, ups = two_nodes
    body = {"model": "tiny", "stream": True,
            "messages": [{"role": "user", "content": "headers please"}]}
    res = requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=10,
                        headers={"User-Agent": "sdk/1.2", "X-Trace-Id": "t-42",
                                 "Accept-Encoding": "gzip", "X-Request-Id": "client-id"})
    assert res.status_code == 200 and "[DONE]" in res.text
    seen = [h for u in ups for h in u.headers_seen if h.get("X-Trace-Id") == "t-42"]
    assert len(seen) == 1, seen
    h = seen[0]
    assert h["User-Agent"] == "sdk/1.2" and "Accept-Encoding" not in h
    own = (edge.rendered.out_dir / "hop-id").read_text().strip()
    assert h["X-Infergate-Hop"] == own and h["X-Request-Id"] == res.headers["X-Request-Id"]
    assert h["X-Request-Id"] != "client-id"
