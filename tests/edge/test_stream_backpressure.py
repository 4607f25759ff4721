"""A relayed stream whose client stops reading: the edge stops reading the node (its
writes wait on the client, as nginx's proxy does with buffering off) and, when the
client reads again, the stream goes on to its end, also after the kernel's buffers
filled and emptied (lua-nginx-module before 0.10.29 left the Lua context on
"body filter" when it flushed pending output, and the next write of the relay failed)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from controlplane import procs
from support.stack import edge_settings

CHUNKS = 600
TEXT = "x" * 32_000   # about 19 MB in all: more than the socket buffers on both sides hold


def _read_all(s: socket.socket, deadline_s: float) -> bytes:
    s.settimeout(deadline_s)
    out = bytearray()
    while True:
        piece = s.recv(1 << 20)
        if not piece:
            return bytes(out)
        out += piece
        if out.endswith(b"0\r\n\r\n"):
            return bytes(out)


def test_a_client_that_stops_reading_gets_the_whole_stream_when_it_reads_again(
        tiny_upstreams, redis_server, edge_factory) -> None:
    (up,) = tiny_upstreams(names=["n1"])
    up.chunks, up.chunk_interval_s, up.chunk_text = CHUNKS, 0.0, TEXT
    edge = edge_factory(edge_settings(redis_server.url, [up.node_settings()]))
    body = json.dumps({"model": "tiny", "stream": True,
                       "messages": [{"role": "user", "content": "a long one"}]}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = urlsplit(edge.url).hostname, urlsplit(edge.url).port
    s.connect((host, port))
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.settimeout(10)
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        # the client reads nothing more until the node has stopped sending for a while:
        # every buffer between them is full
        last, since = -1, time.monotonic()

        def stalled() -> bool:
            nonlocal last, since
            now = time.monotonic()
            if up.stream_chunks_sent != last:
                last, since = up.stream_chunks_sent, now
            return now - since >= 1.0

        procs.wait_until(stalled, timeout=30, what="the node held back by the client")
        assert up.stream_chunks_sent < CHUNKS, "the client's pause did not hold the node back"
        rest = _read_all(s, 30)
    finally:
        s.close()
    text = (head + rest).decode(errors="replace")
    assert text.count('"finish_reason": "stop"') == 1 and "data: [DONE]" in text
    assert text.count(TEXT) == CHUNKS
