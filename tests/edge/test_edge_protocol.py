"""Requests nginx itself refuses before any Lua runs (a request line it cannot parse, a
URI or headers over its buffers, an unknown transfer encoding, an unknown HTTP
version) and loops back into the edge: each still gets a JSON error, never nginx's HTML
page or a 500."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from controlplane import procs
from support.stack import edge_settings

pytestmark = pytest.mark.integration


@pytest.fixture
def edge(redis_server, tiny_upstreams, edge_factory):
    (up,) = tiny_upstreams(1)
    return edge_factory(edge_settings(redis_server.url, [up.node_settings()]))


def raw(edge, data: bytes) -> tuple[int, dict, bytes]:
    host, port = edge.rendered.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if b"\r\n\r\n" in buf:
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, headers, body


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"GET /v1/models\x00 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
    (b"GET /v1/mo dels HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, 400, "bad_request"),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n", 400,
     "header_too_large"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
     501, "not_implemented"),
    (b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
])
def test_requests_nginx_refuses_get_json(edge, request_bytes, status, code) -> None:
    got, headers, body = raw(edge, request_bytes)
    assert got == status
    assert headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == code


def test_a_node_pointing_back_at_the_edge_is_refused(redis_server, edge_factory) -> None:
    # a node registered with the edge's own address: the request comes back with the
    # edge's hop id and is not proxied again
    port = procs.free_port()
    edge = edge_factory(edge_settings(redis_server.url, [
        {"name": "self", "url": f"http://127.0.0.1:{port}"}]), listen=f"127.0.0.1:{port}")
    for stream in (False, True):
        r = requests.post(edge.url + "/v1/chat/completions", timeout=20, json={
            "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 508, (stream, r.text)
        assert r.json()["error"]["code"] == "loop_detected"


def test_a_hop_header_from_a_client_is_passed_on_not_taken_for_a_loop(
        redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(edge_settings(redis_server.url, [up.node_settings()]))
    own = (edge.rendered.out_dir / "hop-id").read_text().strip()
    for stream in (False, True):
        r = requests.post(edge.url + "/v1/chat/completions", timeout=10, json={
            "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Infergate-Hop": "1, <b>x"})
        assert r.status_code == 200, r.text
        # what the node got: the ids before (cleaned), then this edge's
        assert up.headers_seen[-1]["X-Infergate-Hop"] == f"1,bx,{own}"
    assert len(own) == 16


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "0x10"])
def test_numbers_json_does_not_allow_are_refused(edge, number) -> None:
    body = '{"model": "m", "temperature": %s, "messages": [{"role": "user", "content": "hi"}]}' % number
    r = requests.post(edge.url + "/v1/chat/completions", data=body, timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1//chat/completions", "//v1/chat/completions",
                                  "/v1/x/../chat/completions"])
def test_paths_are_forwarded_normalised(edge, path) -> None:
    host, port = edge.rendered.listen.rsplit(":", 1)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    status, _, resp = raw(edge, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nConnection: close\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert status == 200, resp
    assert json.loads(resp)["object"] == "chat.completion"
