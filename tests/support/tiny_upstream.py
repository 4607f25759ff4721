"""The tiny upstream: an in-process OpenAI-compatible HTTP server on a free loopback
port with switchable modes (answer, fail, busy, hang, stall, garbage), for deterministic edge
tests that need no simulated performance model.

Fixture (registered through ``pytest_plugins`` in tests/conftest.py):
``tiny_upstreams(n, names=None)`` -> list of :class:`TinyUpstream`, all stopped at
teardown.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controlplane import procs
from controlplane.config import NodeSettings
from support.stack import snapshot_node


class _Server(ThreadingHTTPServer):
    # the accept queue (listen backlog; socketserver's default is 5): a burst of the
    # edge's new connections past it has SYNs dropped, retried after 1 s, 3 s..., and the
    # edge's 1 s connect timeout then answers 504 for a node that is only slow to accept
    request_queue_size = 128


class TinyUpstream:
    """An in-process OpenAI-compatible HTTP server on a free port.

    ``mode``: ``ok`` (answer), ``fail`` (500 JSON), ``busy`` (429), ``hang`` (never
    answer until released or stopped), ``frozen`` (as ``hang``, GETs too: a stopped
    process whose kernel still accepts connections), ``stall`` (as ``hang``, but a stream gets its
    headers at once, as from vLLM whose engine hangs), ``stall_frozen`` (as ``stall``, GETs
    hang too: llama-server, which sends a stream's headers before its prefill, stopped
    then), ``garbage`` (non-HTTP bytes, then
    close), ``close_reused`` (answer the first request of a connection; close a kept-alive
    connection when a later request arrives on it, as a server that dropped an idle
    connection the moment the proxy reused it), ``cut`` (a 200 JSON answer whose
    Content-Length says 1000 bytes, 10 of them sent, then the connection closed).
    ``delay_s`` delays every answer; ``head_first_s`` delays a stream's first chunk
    after its head (llama-server's prefill); a ``"stream": true`` request gets ``chunks`` SSE
    chunks ``chunk_interval_s`` apart (and, with ``stream_options.include_usage``, a
    last chunk with ``choices: []`` and the usage, as vLLM sends it). ``gate``: when set (a threading.Event), streams
    wait for it before their last chunk. ``hits`` counts inference requests,
    ``inflight`` the ones being answered, ``gets`` the GET requests. Answers carry ``X-Sim-Node`` and
    ``system_fingerprint`` = name. ``gzip``: non-streamed JSON answers are gzip-compressed
for a request that accepts it (as a node behind a compressing proxy answers);
``accept_encodings`` holds every POST's Accept-Encoding (None without one). ``stop()``
closes the port (connections refused)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.delay_s = 0.0
        self.chunks = 5
        self.chunk_interval_s = 0.05
        self.head_first_s = 0.0
        self.gate: threading.Event | None = None
        self.hits = 0
        self.inflight = 0
        self.gets = 0
        self.connections = 0
        """Connections accepted so far."""
        self.post_connections = 0
        """Connections that carried at least one POST (a liveness check's GET /health
        opens a connection of its own)."""
        self.bodies: list[bytes] = []
        self.request_ids: list[str | None] = []
        """X-Request-Id of every POST, in arrival order."""
        self.gzip = False
        self.slots = 0
        """When > 0: GET /slots answers as llama-server's, this many slots, as many busy
        as ``inflight`` (or ``slots_busy`` when set)."""
        self.slots_busy: int | None = None
        self.chunk_text: str | None = None
        self.finish_reason = "stop"
        """The finish reason of every answer (a JSON answer's and a stream's last chunk)."""
        self.completion_tokens = 3
        """The usage's completion tokens of a JSON answer (a stream's: its chunks)."""
        self.stream_usage = True
        """False: a stream has no usage chunk, even when the request asks for one (as a
        server that ignores stream_options)."""
        """When set: the content of every stream chunk (``tok<i> `` otherwise)."""
        self.stream_chunks_sent = 0
        """Stream chunks written so far (a client that stops reading stops it growing)."""
        self.accept_encodings: list[str | None] = []
        self.headers_seen: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._conns: set[socket.socket] = set()
        self.port = procs.free_port()
        self.host = "127.0.0.1"
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def node_settings(self, **kw: Any) -> NodeSettings:
        return NodeSettings(name=self.name, url=self.url, **kw)

    def snapshot_node(self, **kw: Any) -> dict:
        return snapshot_node(self.name, self.host, self.port, **kw)

    def start(self) -> None:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                self.served = 0
                self.posted = False
                with upstream._lock:
                    upstream._conns.add(self.connection)
                    upstream.connections += 1

            def finish(self) -> None:
                with upstream._lock:
                    upstream._conns.discard(self.connection)
                super().finish()

            def _send(self, status: int, obj: Any, headers: dict | None = None) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                if upstream.gzip and "gzip" in (self.headers.get("Accept-Encoding") or ""):
                    body = gzip.compress(body)
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Sim-Node", upstream.name)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                with upstream._lock:
                    upstream.gets += 1
                if upstream.mode in ("frozen", "stall_frozen"):
                    upstream._released.wait(60)
                    self.close_connection = True
                    return
                if self.path == "/slots" and upstream.slots:
                    # llama-server's /slots: a slot is processing while an answer is
                    # worked on, its client gone or not
                    busy = upstream.inflight if upstream.slots_busy is None else upstream.slots_busy
                    self._send(200, [{"id": i, "is_processing": i < busy}
                                     for i in range(upstream.slots)])
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": "tiny", "object": "model", "created": 0, "owned_by": upstream.name}]})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                               "param": None, "code": None}})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                with upstream._lock:
                    if not self.posted:
                        self.posted = True
                        upstream.post_connections += 1
                    upstream.hits += 1
                    upstream.inflight += 1
                    upstream.bodies.append(raw)
                    upstream.request_ids.append(self.headers.get("X-Request-Id"))
                    upstream.accept_encodings.append(self.headers.get("Accept-Encoding"))
                    upstream.headers_seen.append(dict(self.headers))
                try:
                    self._answer(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with upstream._lock:
                        upstream.inflight -= 1

            def _answer(self, raw: bytes) -> None:
                mode = upstream.mode
                self.served += 1
                if mode == "close_reused" and self.served > 1:
                    self.close_connection = True
                    return
                if upstream.delay_s:
                    time.sleep(upstream.delay_s)
                if mode in ("hang", "frozen"):
                    upstream._released.wait(60)
                    self.close_connection = True
                    return
                if mode in ("stall", "stall_frozen"):
                    try:
                        streams = json.loads(raw or b"{}").get("stream") is True
                    except (ValueError, AttributeError):
                        streams = False
                    if streams:
                        self._stream_headers()
                    upstream._released.wait(60)
                    self.close_connection = True
                    return
                if mode == "cut":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "1000")
                    self.send_header("X-Sim-Node", upstream.name)
                    self.end_headers()
                    self.wfile.write(b'{"id": "cu')
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if mode == "garbage":
                    self.wfile.write(b"\x00\x01 this is not HTTP \xff\r\n\r\n")
                    self.close_connection = True
                    return
                if mode == "fail":
                    self._send(500, {"error": {"message": "simulated failure", "type": "server_error",
                                               "param": None, "code": 500}})
                    return
                if mode == "busy":
                    self._send(429, {"error": {"message": "busy", "type": "rate_limit_error",
                                               "param": None, "code": 429}})
                    return
                if self.path.split("?")[0] not in ("/v1/chat/completions", "/v1/completions",
                                                   "/v1/embeddings"):
                    self._send(404, {"error": {"message": f"no route {self.path}",
                                               "type": "invalid_request_error",
                                               "param": None, "code": "not_found"}})
                    return
                try:
                    req = json.loads(raw or b"{}")
                except ValueError:
                    req = {}
                model = req.get("model", "tiny") if isinstance(req, dict) else "tiny"
                if self.path == "/v1/embeddings":
                    self._send(200, {"object": "list", "model": model, "data": [
                        {"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                        "usage": {"prompt_tokens": 1, "total_tokens": 1}})
                    return
                if isinstance(req, dict) and req.get("stream"):
                    opts = req.get("stream_options")
                    self._stream(model, isinstance(opts, dict) and opts.get("include_usage") is True)
                    return
                self._send(200, {
                    "id": "chatcmpl-tiny", "object": "chat.completion", "created": int(time.time()),
                    "model": model, "system_fingerprint": upstream.name,
                    "choices": [{"index": 0, "finish_reason": upstream.finish_reason,
                                 "message": {"role": "assistant", "content": f"hello from {upstream.name}"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": upstream.completion_tokens,
                              "total_tokens": 3 + upstream.completion_tokens}})

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _stream_headers(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("X-Sim-Node", upstream.name)
                self.end_headers()
                self.wfile.flush()

            def _stream(self, model: str, include_usage: bool = False) -> None:
                self._stream_headers()
                if upstream.head_first_s:
                    time.sleep(upstream.head_first_s)   # a long prefill after the head
                for i in range(upstream.chunks):
                    if i == upstream.chunks - 1 and upstream.gate is not None:
                        upstream.gate.wait(30)
                    elif i:
                        time.sleep(upstream.chunk_interval_s)
                    ev = {"id": "chatcmpl-tiny", "object": "chat.completion.chunk",
                          "created": int(time.time()), "model": model,
                          "system_fingerprint": upstream.name,
                          "choices": [{"index": 0, "delta": {
                              "content": upstream.chunk_text or f"tok{i} "},
                                       "finish_reason": upstream.finish_reason
                                       if i == upstream.chunks - 1
                                       else None}]}
                    self._chunk(f"data: {json.dumps(ev)}\n\n".encode())
                    upstream.stream_chunks_sent += 1
                if include_usage and upstream.stream_usage:
                    ev = {"id": "chatcmpl-tiny", "object": "chat.completion.chunk",
                          "created": int(time.time()), "model": model,
                          "system_fingerprint": upstream.name, "choices": [],
                          "usage": {"prompt_tokens": 3, "completion_tokens": upstream.chunks,
                                    "total_tokens": 3 + upstream.chunks}}
                    self._chunk(f"data: {json.dumps(ev)}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

        self._released.clear()
        self._server = _Server((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"tiny-{self.name}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let hanging requests end (they close without an answer)."""
        self._released.set()

    def hold(self) -> None:
        """After :meth:`release`: requests in ``hang`` mode hang again until the next one."""
        self._released.clear()

    def stop(self) -> None:
        """Close the listening port and every open connection (kept-alive ones too),
        ending hanging requests: afterwards connects are refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._released.set()
        if self.gate is not None:
            self.gate.set()


@pytest.fixture
def tiny_upstreams() -> Iterator[Callable[..., list[TinyUpstream]]]:
    """Factory: ``tiny_upstreams(3)`` or ``tiny_upstreams(names=["a", "b"])``."""
    started: list[TinyUpstream] = []

    def start(n: int = 1, names: list[str] | None = None) -> list[TinyUpstream]:
        names = names or [f"tiny-{len(started) + i + 1}" for i in range(n)]
        out = [TinyUpstream(name) for name in names]
        started.extend(out)
        return out

    try:
        yield start
    finally:
        for u in started:
            u.stop()
