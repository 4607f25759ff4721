"""Bad and extreme input at the edge, against a real nginx: each gets a defined answer,
never a worker crash (the edge_factory teardown fails the test on any [alert], [crit]
or Lua runtime error in the error log, and checks in-flight counters are back to zero).

| input                                        | answer                                      |
|----------------------------------------------|---------------------------------------------|
| body stalls longer than client_body_timeout  | 408 JSON ``request_timeout``, connection closed |
| chunked body that stalls                     | connection closed without an answer (nginx)  |
| body trickling past client_body_deadline_ms  | 408 JSON ``request_timeout``, connection closed |
| chunked body trickling past that deadline    | 408 JSON ``request_timeout``, connection closed |
| malformed chunked body                       | 400 JSON ``bad_request`` (nginx's check)     |
| chunked body with Expect: 100-continue       | 100, then proxied                            |
| chunked body over client_max_body_size       | 413 JSON ``request_too_large`` (not nginx's HTML) |
| large body (4 MB, in memory)                 | proxied byte for byte                        |
| body spilled to a temp file (small buffer)   | proxied byte for byte                        |
| invalid UTF-8                                | 400 JSON ``invalid_utf8``                    |
| 990 or 10,000 nested arrays or objects       | 400 JSON ``json_too_deep`` (edge.max_json_depth 64) |
| 60 nested arrays (under the limit)           | proxied                                      |
| 10,000-message conversation                  | proxied (and cached)                         |
| 100,000-message conversation (~6 MB)         | 400 JSON ``too_many_messages``, fast         |
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import socket
import time

import pytest
import requests

from controlplane import procs
from controlplane.config import settings_from_dict
from support.stack import edge_settings

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


@pytest.fixture
def edge_and_node(redis_server, tiny_upstreams, edge_factory):
    (up,) = tiny_upstreams(1)
    s = edge_settings(redis_server.url, [up.node_settings()], client_body_timeout_ms=500)
    s = settings_from_dict({**s.model_dump(mode="json"), "cache": {"enabled": True, "semantic": False}})
    return edge_factory(s), up


def post_raw(edge, body: bytes, headers: dict | None = None) -> requests.Response:
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    return requests.post(edge.url + CHAT, data=body, headers=h, timeout=30)


def error_code(res: requests.Response) -> str:
    assert res.headers["Content-Type"].startswith("application/json"), res.headers
    return res.json()["error"]["code"]


def _host_port(edge) -> tuple[str, int]:
    host, port = edge.rendered.listen.rsplit(":", 1)
    return host, int(port)


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    sock.settimeout(timeout)
    t0 = time.monotonic()
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def test_slow_body_gets_408_json_and_the_connection_closes(edge_and_node) -> None:
    edge, up = edge_and_node
    with socket.create_connection(_host_port(edge)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n{\"model\": \"m\", ")
        data, took = _read_until_closed(s, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert re.search(rb"(?i)^connection: close", head, re.M), head
    assert b'"code":"request_timeout"' in body
    assert took < 5, took  # client_body_timeout is 0.5 s
    assert up.hits == 0
    # the edge is fine afterwards
    assert post_raw(edge, json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()).status_code == 200


def test_slow_chunked_body_is_closed_by_nginx(edge_and_node) -> None:
    """nginx decodes chunked bodies itself; a stall past its client_body_timeout ends the
    connection without an answer (logged as 408 in the access log)."""
    edge, up = edge_and_node
    with socket.create_connection(_host_port(edge)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
        data, took = _read_until_closed(s, 10)
    assert data == b"" and took < 5
    assert up.hits == 0
    procs.wait_until(lambda: '" 408 ' in edge.access_log(), 5, what="408 in the access log")
    assert "uninitialized" not in edge.error_log()


def test_a_client_that_leaves_in_its_headers_is_logged_without_warnings(edge_and_node) -> None:
    """nginx logs such a request (400) before any location ran, so $infergate_request_id
    (which the access log's $infergate_rid reads) was never set: no warning for it."""
    edge, up = edge_and_node
    with socket.create_connection(_host_port(edge)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    procs.wait_until(lambda: '" 400 ' in edge.access_log(), 5, what="400 in the access log")
    assert "uninitialized" not in edge.error_log()
    assert up.hits == 0


def test_a_client_that_half_closes_after_its_body_is_not_answered_400(edge_and_node) -> None:
    """A whole body, then shutdown(SHUT_WR): the edge sees the client's side closed, as
    nginx's proxy does (499, no answer), never "400 the request body could not be read"
    counted as the client's bad request."""
    edge, up = edge_and_node
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    with socket.create_connection(_host_port(edge)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        s.shutdown(socket.SHUT_WR)
        data, _ = _read_until_closed(s, 10)
    assert b" 400 " not in data.split(b"\r\n", 1)[0], data[:200]
    assert b"could not be read" not in data
    if not data:
        procs.wait_until(lambda: '" 499 ' in edge.access_log(), 5, what="499 in the access log")
    assert '" 400 ' not in edge.access_log()


def _chunked(body: bytes, size: int) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                   for i in range(0, len(body), size))
    return out + b"0\r\n\r\n"


def test_chunked_bodies_are_decoded_and_proxied(edge_and_node) -> None:
    """Chunk extensions and trailer fields are ignored, Expect: 100-continue gets its 100
    first; the node gets the decoded body, the client a 200 on a connection it can use
    again."""
    edge, up = edge_and_node
    payload = json.dumps({"model": "m", "messages": [{"role": "user", "content": "chunked é" * 300}]}).encode()
    wire = _chunked(payload, 700).replace(b"\r\n", b";ext=1\r\n", 1)
    wire = wire[:-2] + b"X-Trailer: t\r\n\r\n"
    with socket.create_connection(_host_port(edge)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n")
        s.settimeout(5)
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(wire)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), data
        length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
        while len(body) < length:
            body += s.recv(65536)
        assert json.loads(body)["choices"]
    assert up.hits == 1 and up.bodies[-1] == payload


@pytest.mark.parametrize("wire", [b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabcdef\r\n0\r\n\r\n"])
def test_malformed_chunked_body_is_400(edge_and_node, wire: bytes) -> None:
    edge, up = edge_and_node
    with socket.create_connection(_host_port(edge)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + wire)
        data, _ = _read_until_closed(s, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), data
    assert b'"code":"bad_request"' in body and b"<html" not in body
    assert up.hits == 0


@pytest.mark.parametrize("framing,first,more", [
    (b"Content-Length: 200", b"{", b" "),
    (b"Transfer-Encoding: chunked", b"1\r\n{\r\n", b"1\r\n \r\n"),
], ids=["content-length", "chunked"])
def test_trickled_body_is_cut_by_the_total_deadline(redis_server, tiny_upstreams, edge_factory,
                                                    framing: bytes, first: bytes,
                                                    more: bytes) -> None:
    """One byte (or one 1-byte chunk) every 0.2 s never trips the 0.5 s gap timeout; the
    1.5 s total deadline cuts it with a 408 JSON."""
    (up,) = tiny_upstreams(1)
    edge = edge_factory(edge_settings(redis_server.url, [up.node_settings()],
                                      client_body_timeout_ms=500, client_body_deadline_ms=1500))
    t0 = time.monotonic()
    with socket.create_connection(_host_port(edge)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + framing + b"\r\n\r\n" + first)
        s.settimeout(0.2)
        data = b""
        while time.monotonic() - t0 < 10:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                try:
                    s.sendall(more)
                except OSError:
                    break
                continue
            if not chunk:
                break
            data += chunk
    took = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert re.search(rb"(?i)^connection: close", head, re.M), head
    assert b'"code":"request_timeout"' in body
    assert 1.4 < took < 5, took
    assert up.hits == 0
    assert "uninitialized" not in edge.error_log()


def test_chunked_body_over_the_limit_gets_413_json(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(edge_settings(redis_server.url, [up.node_settings()],
                                      client_max_body_size="2m"))

    def chunks():
        # over 1m as well: nginx's default limit, which applied again on the way to the
        # error page before (and answered its HTML page)
        for _ in range(200):
            yield b"a" * 16384

    res = requests.post(edge.url + CHAT, data=chunks(), timeout=30,
                        headers={"Content-Type": "application/json"})
    assert res.status_code == 413
    assert error_code(res) == "request_too_large"
    assert up.hits == 0
    # with Content-Length: the same answer
    res = post_raw(edge, b"a" * (3 * 1024 * 1024))
    assert res.status_code == 413 and error_code(res) == "request_too_large"


def test_large_body_is_proxied_byte_for_byte(edge_and_node) -> None:
    edge, up = edge_and_node
    text = "é" * (2 * 1024 * 1024)  # 4 MB of UTF-8
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]},
                      ensure_ascii=False).encode()
    res = post_raw(edge, body)
    assert res.status_code == 200, res.text
    assert hashlib.sha256(up.bodies[-1]).hexdigest() == hashlib.sha256(body).hexdigest()


def test_body_over_the_buffer_goes_to_a_temp_file_and_is_proxied(redis_server, tiny_upstreams,
                                                                 edge_factory) -> None:
    """A body over edge.client_body_buffer_size is kept in a temp file, as plain nginx
    keeps it (a slow upload holds that much memory, not the whole body): it is still
    validated, rewritten where the edge adds to it, and sent unchanged otherwise."""
    (up,) = tiny_upstreams(1)
    s = edge_settings(redis_server.url, [up.node_settings()], client_body_buffer_size="16k")
    s = settings_from_dict({**s.model_dump(mode="json"), "cache": {"enabled": True, "semantic": False}})
    edge = edge_factory(s)
    assert "client_body_buffer_size 16k;" in edge.rendered.server_conf.read_text()
    old_log = edge.error_log()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 300000}]}).encode()
    chunked = iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
    for res in (post_raw(edge, body), requests.post(edge.url + CHAT, data=chunked, timeout=30,
                                                   headers={"Content-Type": "application/json"})):
        assert res.status_code == 200, res.text
        assert up.bodies[-1] == body
    procs.wait_until(lambda: "buffered to a temporary file" in edge.error_log()[len(old_log):],
                     timeout=5, what="nginx's warning that the body went to a temporary file")
    # a cacheable stream: the edge asks the node for usage in the body it read from the file
    stream = json.dumps({"model": "m", "stream": True, "temperature": 0,
                         "messages": [{"role": "user", "content": "y" * 300000}]}).encode()
    res = post_raw(edge, stream)
    assert res.status_code == 200, res.text
    sent = json.loads(up.bodies[-1])
    assert sent["messages"] == json.loads(stream)["messages"]
    assert sent.get("stream_options", {}).get("include_usage") is True
    bad = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 30000}]}).encode()
    res = post_raw(edge, bad[:-1])
    assert res.status_code == 400 and error_code(res) == "invalid_json"


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": [{"role": "user", "content": "bad \xff\xfe byte"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "overlong \xc0\xaf"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "surrogate \xed\xa0\x80"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "cut \xe4\xb8"}]}',
])
def test_invalid_utf8_is_400(edge_and_node, raw: bytes) -> None:
    edge, up = edge_and_node
    res = post_raw(edge, raw)
    assert res.status_code == 400 and error_code(res) == "invalid_utf8"
    assert up.hits == 0


@pytest.mark.parametrize("model", [b"5", b"true", b'["m"]', b'{"id": "m"}'])
def test_a_model_that_is_not_a_string_is_400(edge_and_node, model: bytes) -> None:
    """The OpenAI API's model is a string id: any other JSON value is refused at the edge
    (before, it was routed as if no model were named); null and no model still pass."""
    edge, up = edge_and_node
    res = post_raw(edge, b'{"model": ' + model + b', "messages": [{"role": "user", '
                   b'"content": "hi"}]}')
    assert res.status_code == 400 and error_code(res) == "invalid_model", res.text
    assert "'model' must be a string" in res.json()["error"]["message"]
    assert res.json()["error"]["param"] == "model"
    assert up.hits == 0
    for body in (b'{"model": null, "messages": [{"role": "user", "content": "hi"}]}',
                 b'{"messages": [{"role": "user", "content": "hi"}]}'):
        assert post_raw(edge, body).status_code == 200


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_an_output_limit_below_0_or_above_int32_is_400(edge_and_node, field: str) -> None:
    """llama.cpp reads max_tokens -1 as no limit: such an answer held a slot for minutes
    past the client's 504 and reserved nothing against the key's tokens per minute. A
    negative limit is refused at the edge, as vLLM and the OpenAI API refuse it, and so is
    one above 2^31 - 1 (llama.cpp's 32-bit int: 4294967295 read as -1); 0 and a positive
    limit up to that pass."""
    edge, up = edge_and_node
    msgs = [{"role": "user", "content": "hi"}]
    for v in (-1, -2, -0.5, -10**12):
        res = post_raw(edge, json.dumps({"model": "m", "messages": msgs, field: v}).encode())
        assert res.status_code == 400 and error_code(res) == "integer_below_min_value", res.text
        err = res.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error"
        assert field in err["message"] and "leave the field out" in err["message"]
    # a body passed through to another path under /v1 is refused the same
    res = requests.post(edge.url + "/v1/messages", json={"model": "m", "messages": msgs,
                                                         field: -1}, timeout=30)
    assert res.status_code == 400 and error_code(res) == "integer_below_min_value", res.text
    assert up.hits == 0
    # above 2^31 - 1: llama-server read 4294967295 into a 32-bit int as -1, no limit
    for raw in (b"2147483648", b"4294967295", b"9223372036854775807", b"1e12", b"1e400"):
        body = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "'
                + field.encode() + b'": ' + raw + b"}")
        res = post_raw(edge, body)
        if raw == b"1e400":   # not a number JSON allows here (infinite): the body's 400
            assert res.status_code == 400, res.text
            continue
        assert res.status_code == 400 and error_code(res) == "integer_above_max_value", res.text
        assert res.json()["error"]["param"] == field
    assert up.hits == 0
    for v in (0, 1, 64, 2147483647):
        res = post_raw(edge, json.dumps({"model": "m", "messages": msgs, field: v}).encode())
        assert res.status_code == 200, (v, res.text)
    assert up.hits == 4


@pytest.mark.parametrize("messages, param", [
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "system", "content": "be brief"}, {"role": None, "content": "hi"}],
     "messages[1].role"),
    ([{"role": "user", "content": "a"}, "hi"], "messages[1].role"),
    ([{"role": 3, "content": "hi"}], "messages[0].role"),
])
def test_a_message_without_a_role_is_400(edge_and_node, messages: list, param: str) -> None:
    """Each chat message is an object with a string role (the OpenAI API's 400
    missing_required_parameter); llama-server answered a message without one with a 500,
    which read as the node's fault. Streamed or not, the edge refuses it."""
    edge, up = edge_and_node
    for stream in (False, True):
        body = {"model": "m", "messages": messages, "stream": stream}
        res = post_raw(edge, json.dumps(body).encode())
        assert res.status_code == 400, res.text
        err = res.json()["error"]
        assert err["code"] == "missing_required_parameter" and err["param"] == param, err
        assert param in err["message"]
    assert up.hits == 0
    ok = [{"role": "user", "content": "hi"}]
    assert post_raw(edge, json.dumps({"model": "m", "messages": ok}).encode()).status_code == 200


def test_a_model_name_over_512_bytes_is_400(edge_and_node) -> None:
    """A model name goes into Redis key names and metrics labels: one over 512 bytes (a
    1 MB name made a 1 MB key per request) is refused at the edge; 512 bytes pass."""
    edge, up = edge_and_node
    for n, status in ((513, 400), (1 << 20, 400), (512, 200)):
        body = json.dumps({"model": "m" * n, "messages": [{"role": "user", "content": "hi"}]})
        res = post_raw(edge, body.encode())
        assert res.status_code == status, (n, res.text[:300])
        if status == 400:
            err = res.json()["error"]
            assert err["code"] == "invalid_model" and err["param"] == "model"
            assert "longer than 512 bytes" in err["message"] and len(res.content) < 1000
    assert up.hits == 1


def test_valid_utf8_and_escapes_pass(edge_and_node) -> None:
    edge, up = edge_and_node
    for content in ("你好，世界", "emoji 🚀 and ünïcödé", "\\ud83d\\ude80 escaped pair"):
        raw = ('{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % content).encode()
        res = post_raw(edge, raw)
        assert res.status_code == 200, (content, res.text)
        assert up.bodies[-1] == raw
    # a lone escaped surrogate is valid JSON text: a defined answer either way
    res = post_raw(edge, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}')
    assert res.status_code in (200, 400), res.text


@pytest.mark.parametrize("levels", [990, 10000])
@pytest.mark.parametrize("opening,closing", [("[", "]"), ('{"a":', "}")])
def test_deep_nesting_is_400_and_never_reaches_a_node(edge_and_node, opening: str, closing: str,
                                                      levels: int) -> None:
    edge, up = edge_and_node
    deep = opening * levels + "1" + closing * levels
    raw = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": %s}' % deep).encode()
    res = post_raw(edge, raw)
    assert res.status_code == 400 and error_code(res) == "json_too_deep", res.text
    assert res.json()["error"]["type"] == "invalid_request_error"
    assert "64 levels" in res.json()["error"]["message"]
    assert up.hits == 0


def test_nesting_under_the_limit_is_proxied(edge_and_node) -> None:
    edge, up = edge_and_node
    deep = "[" * 60 + "1" + "]" * 60
    raw = ('{"model": "m", "messages": [{"role": "user", "content": "deep"}], "x": %s}' % deep).encode()
    res = post_raw(edge, raw)
    assert res.status_code == 200, res.text
    assert up.bodies[-1] == raw


def test_body_limits_are_configurable(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(edge_settings(redis_server.url, [up.node_settings()],
                                      max_json_depth=8, max_messages=3))
    msgs = [{"role": "user", "content": "x"}] * 3
    assert post_raw(edge, json.dumps({"model": "m", "messages": msgs}).encode()).status_code == 200
    res = post_raw(edge, json.dumps({"model": "m", "messages": msgs + msgs[:1]}).encode())
    assert res.status_code == 400 and error_code(res) == "too_many_messages", res.text
    assert res.json()["error"]["param"] == "messages"
    res = post_raw(edge, json.dumps({"model": "m", "messages": msgs, "x": [[[[[[[[1]]]]]]]]}).encode())
    assert res.status_code == 400 and error_code(res) == "json_too_deep", res.text
    assert up.hits == 1


def test_hundred_thousand_messages_are_refused_fast(edge_and_node) -> None:
    edge, up = edge_and_node
    msgs = [{"role": "user", "content": f"message number {i} with a little padding"} for i in range(100000)]
    body = json.dumps({"model": "m", "messages": msgs}).encode()
    assert len(body) > 6_000_000
    t0 = time.monotonic()
    res = post_raw(edge, body)
    took = time.monotonic() - t0
    assert res.status_code == 400 and error_code(res) == "too_many_messages", res.text
    assert up.hits == 0
    # the worker is free again at once: a normal request right after is answered quickly
    t1 = time.monotonic()
    ok = post_raw(edge, b'{"model": "m", "messages": [{"role": "user", "content": "next"}]}')
    assert ok.status_code == 200 and time.monotonic() - t1 < 1.0
    print(f"100,000-message body ({len(body)} bytes): 400 in {took * 1000:.0f} ms (upload included)")
    assert took < 3, took


def test_ten_thousand_messages_are_proxied_and_cached(edge_and_node, redis_server,
                                                      tiny_upstreams, edge_factory) -> None:
    """A 10,000-message conversation (about 30,000 JSON members) is proxied; at the
    default cache.max_request_members (5,000) it skips the cache, with the limit raised
    it is stored and answered from the cache."""
    edge, up = edge_and_node
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(10000)]
    body = json.dumps({"model": "m", "messages": msgs}).encode()
    res = post_raw(edge, body)
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "BYPASS"
    (up,) = tiny_upstreams(1)
    s = edge_settings(redis_server.url, [up.node_settings()], client_body_timeout_ms=500)
    s = settings_from_dict({**s.model_dump(mode="json"),
                            "cache": {"enabled": True, "semantic": False,
                                      "max_request_members": 40000}})
    edge = edge_factory(s)
    t0 = time.monotonic()
    res = post_raw(edge, body)
    took = time.monotonic() - t0
    assert res.status_code == 200, res.text
    assert res.headers["X-Cache-Status"] == "MISS"
    assert len(json.loads(up.bodies[-1])["messages"]) == 10000
    assert took < 5, took
    deadline = time.monotonic() + 5
    while post_raw(edge, body).headers.get("X-Cache-Status") != "HIT":
        assert time.monotonic() < deadline, "the long conversation was never served from the cache"
    print(f"10,000-message conversation ({len(body)} bytes): first answer in {took * 1000:.0f} ms")


def test_a_body_that_arrives_past_the_request_deadline_gets_408_not_429(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """A body sent slowly enough to use up deadlines.request_ms (here 1 s; within the gap
    and total body timeouts) is the client's delay: 408 ``request_timeout`` naming the
    time it took, not a 429 that blames a saturated pool; a faster one is served."""
    (up,) = tiny_upstreams(1)
    s = edge_settings(redis_server.url, [up.node_settings()], client_body_timeout_ms=2000)
    s = settings_from_dict({**s.model_dump(mode="json"), "deadlines": {"request_ms": 1000}})
    edge = edge_factory(s)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()

    def send(pause_s: float) -> tuple[bytes, bytes]:
        with socket.create_connection(_host_port(edge)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
            time.sleep(pause_s)  # the client's own upload delay, the point of the test
            sock.sendall(body[5:])
            data, _ = _read_until_closed(sock, 10)
        head, _, rest = data.partition(b"\r\n\r\n")
        return head, rest

    head, rest = send(1.3)
    assert head.startswith(b"HTTP/1.1 408"), head
    err = json.loads(rest[rest.index(b"{"):rest.rindex(b"}") + 1])["error"]  # maybe chunked
    assert err["code"] == "request_timeout" and "past its deadline of 1 s" in err["message"]
    assert up.hits == 0
    head, _ = send(0.1)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert up.hits == 1


def test_a_compressed_body_gets_415_naming_the_encoding(edge_and_node) -> None:
    edge, up = edge_and_node
    raw = gzip.compress(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"}]}).encode())
    res = post_raw(edge, raw, {"Content-Encoding": "gzip"})
    assert res.status_code == 415 and error_code(res) == "unsupported_content_encoding"
    assert "Content-Encoding gzip is not supported" in res.json()["error"]["message"]
    assert up.hits == 0
    # the connection's next request is read as it should be (the body was discarded)
    s = requests.Session()
    s.post(edge.url + CHAT, data=raw, headers={"Content-Encoding": "gzip"}, timeout=10)
    ok = s.post(edge.url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                timeout=10)
    assert ok.status_code == 200, ok.text
    # "identity" is no encoding
    ok = post_raw(edge, json.dumps({"model": "m", "messages": [{"role": "user", "content": "y"}]}
                                   ).encode(), {"Content-Encoding": "identity"})
    assert ok.status_code == 200, ok.text
