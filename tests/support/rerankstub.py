"""A rerank endpoint in the published Jina/Cohere shape (as llama.cpp ``/v1/rerank``,
vLLM ``/v1/rerank`` and ``/rerank`` serve it), in process on a free loopback port, for the
embedder's tests of the pool's models.

``POST /v1/rerank`` ``{"model", "query", "documents": [str], "top_n"?}`` -> ``{"model",
"object": "list", "results": [{"index", "relevance_score"}], "usage"}``, results sorted by
score, best first (as the servers do). The score is the Jaccard overlap of the lowercase
words of the query and the document (0-1), so paraphrases that share most words score
high and others low.

``POST /v1/embeddings`` ``{"model", "input": [str]}`` -> OpenAI's ``{"object": "list",
"data": [{"object": "embedding", "index", "embedding"}], "model"}``: a bag of the
lowercase words hashed into :data:`DIM` dimensions (cheap, for calibrations of many
pairs; the serving tests use a real ``llama-server --embeddings``).

``mode``: ``ok``, ``down`` (503 JSON), ``refuse`` (400 JSON) or ``slow`` (waits
``delay_s`` before answering).
``calls`` counts requests.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from controlplane import procs


DIM = 64


def bag(text: str) -> list[float]:
    v = [0.0] * DIM
    for w in re.findall(r"\w+", text.lower()):
        v[int(hashlib.sha256(w.encode()).hexdigest()[:8], 16) % DIM] += 1.0
    return v


def jaccard(a: str, b: str) -> float:
    wa, wb = set(re.findall(r"\w+", a.lower())), set(re.findall(r"\w+", b.lower()))
    return len(wa & wb) / len(wa | wb) if wa | wb else 0.0


class RerankStub:
    """The server (see the module); :meth:`stop` at the end."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.delay_s = 2.0
        self.calls = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                stub.calls += 1
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if stub.mode == "slow":
                    time.sleep(stub.delay_s)
                if stub.mode == "refuse":  # as a server refusing a text over its context
                    self._send(400, {"error": {"message": "input is too large", "type": "x"}})
                    return
                if stub.mode == "down" or self.path not in ("/v1/rerank", "/rerank",
                                                            "/v1/embeddings"):
                    self._send(503, {"error": {"message": "unavailable", "type": "x"}})
                    return
                if self.path == "/v1/embeddings":
                    self._send(200, {"object": "list", "model": body.get("model"), "data": [
                        {"object": "embedding", "index": i, "embedding": bag(t)}
                        for i, t in enumerate(body["input"])]})
                    return
                docs = body.get("documents") or []
                res = sorted(({"index": i, "relevance_score": jaccard(body["query"], d)}
                              for i, d in enumerate(docs)),
                             key=lambda r: -r["relevance_score"])
                self._send(200, {"model": body.get("model"), "object": "list",
                                 "results": res[:body.get("top_n") or len(res)],
                                 "usage": {"prompt_tokens": 0, "total_tokens": 0}})

            def _send(self, status: int, doc: dict) -> None:
                raw = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.port = procs.free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.root}/v1/rerank"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
