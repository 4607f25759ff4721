"""Hostile request bodies and a hostile embedder against a real nginx edge, redis-server
and a simulated node: the member bound, the cache's request-size bound, and semantic
hits that must stay inside the request's namespace (a fake embedder, an HTTP server in
this module, answers every lookup with the key it is told to)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from controlplane import procs
from controlplane.cache.key import keys_for
from controlplane.config import Settings
from controlplane.redisdb import keynames
from controlplane.simnode import launch
from support.stack import SimNode, edge_settings

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
MODEL = "sim-llama"


@dataclass
class FakeEmbedder:
    """Answers every lookup of a POST /v1/lookups with a hit on ``key`` (no hit while it is
    None); ``lookups`` holds the lookups received."""

    key: str | None = None
    lookups: list[dict] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def _start_fake_embedder() -> FakeEmbedder:
    fake = FakeEmbedder()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            n = int(self.headers.get("Content-Length") or 0)
            items = json.loads(self.rfile.read(n) or b"{}").get("lookups") or []
            fake.lookups.extend(items)
            doc: dict[str, Any] = {"hit": False}
            if fake.key:
                doc = {"hit": True, "key": fake.key, "similarity": 0.99}
            data = json.dumps({"results": [doc] * len(items)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    fake.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=fake.server.serve_forever, daemon=True).start()
    return fake


@dataclass
class Stack:
    redis_url: str
    r: redis.Redis
    node: SimNode
    embedder: FakeEmbedder


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    d = Path(tempfile.mkdtemp(prefix="infergate-bounds-"))
    d.chmod(0o755)
    ps = procs.ProcessSet()
    fake = _start_fake_embedder()
    try:
        redis_m, rport = procs.start_redis_free_port(d / "redis")
        ps.add(redis_m)
        node = launch.start_node("sim-b", d / "logs", "--time-scale", "0.02",
                                 "--output-tokens", "4:8", into=ps, cls=SimNode)
        r = redis.Redis(host="127.0.0.1", port=rport, decode_responses=True, socket_timeout=2)
        yield Stack(f"redis://127.0.0.1:{rport}/0", r, node, fake)
    finally:
        assert fake.server is not None
        fake.server.shutdown()
        ps.stop_all()
        shutil.rmtree(d, ignore_errors=True)


def settings(stack: Stack, **cache: Any) -> Settings:
    s = edge_settings(stack.redis_url, [stack.node.node_settings()], workers=1)
    c = {"enabled": True, "embedder_url": stack.embedder.url, "semantic_budget_ms": 2000,
         "coalesce": False}
    c.update(cache)
    s.cache = s.cache.model_validate(c)
    return s


def body_of(content: str, system: str | None = None, **params: Any) -> dict:
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": content})
    return {"model": MODEL, "messages": msgs, "temperature": 0, **params}


def post(edge, body: dict | str, timeout: float = 60) -> requests.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(edge.url + CHAT, data=data, timeout=timeout,
                         headers={"Content-Type": "application/json"})


def stored(stack: Stack, body: dict) -> str:
    key = keys_for(CHAT, body, "default").exact
    procs.wait_until(lambda: stack.r.exists(keynames.cache_entry(key)), 10, what="entry")
    return key


# ------------------------------------------------------------------- member bound


def test_body_with_hundreds_of_thousands_of_fields_is_refused_fast(stack, edge_factory) -> None:
    edge = edge_factory(settings(stack))
    hostile = json.dumps({"model": MODEL, "max_tokens": 1,
                          "messages": [{"role": "user", "content": "hi"}],
                          **{f"k{i}": i for i in range(450000)}})
    assert len(hostile) < 8 * 1024 * 1024
    n = int(stack.node.state()["requests_total"])
    t0 = time.monotonic()
    res = post(edge, hostile)
    took = time.monotonic() - t0
    assert res.status_code == 400, res.text[:300]
    err = res.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "too_many_json_members"
    assert int(stack.node.state()["requests_total"]) == n
    assert took < 1.5, f"refusing took {took:.2f}s"
    # the worker is free again at once
    assert post(edge, body_of("Still there?", max_tokens=2)).status_code == 200


def test_member_bound_is_configurable_and_counts_nested_members(stack, edge_factory) -> None:
    s = settings(stack)
    s.edge.max_json_members = 200
    edge = edge_factory(s)
    ok = body_of("count me", metadata={"tags": list(range(150))})
    assert post(edge, ok).status_code == 200
    over = body_of("count me", metadata={"tags": list(range(250))})
    res = post(edge, over)
    assert res.status_code == 400 and res.json()["error"]["code"] == "too_many_json_members"
    # commas and brackets inside strings are text, not members
    text = body_of("[1,2,3]," * 100 + "{}" * 100)
    assert post(edge, text).status_code == 200


# ------------------------------------------------------------------- cache size bound


def test_body_over_max_request_bytes_bypasses_the_cache(stack, edge_factory) -> None:
    edge = edge_factory(settings(stack, max_request_bytes=4096))
    small = body_of("A short question about rivers.")
    assert post(edge, small).headers["X-Cache-Status"] == "MISS"
    big = body_of("A long question about lakes. " + "x" * 5000)
    first = post(edge, big)
    assert first.status_code == 200 and first.headers["X-Cache-Status"] == "BYPASS"
    time.sleep(0.3)
    assert post(edge, big).headers["X-Cache-Status"] == "BYPASS"
    assert not stack.r.exists(keynames.cache_entry(keys_for(CHAT, big, "default").exact))


# ------------------------------------------------------------------- semantic trust


def test_semantic_hit_on_another_namespace_is_not_served(stack, edge_factory) -> None:
    edge = edge_factory(settings(stack))
    stack.embedder.key = None
    secret = body_of("What is our launch date?", system="You are the assistant of team A.")
    first = post(edge, secret)
    assert first.headers["X-Cache-Status"] == "MISS"
    key = stored(stack, secret)
    # the embedder now claims every prompt is a paraphrase of team A's entry
    stack.embedder.key = key
    try:
        other = body_of("Tell me a joke.", system="You are the assistant of team B.")
        assert keys_for(CHAT, other, "default").namespace != keys_for(CHAT, secret,
                                                                      "default").namespace
        n = len(stack.embedder.lookups)
        res = post(edge, other)
        assert len(stack.embedder.lookups) == n + 1  # the lookup happened
        assert res.status_code == 200
        assert res.headers["X-Cache-Status"] == "MISS"
        assert "X-Infergate-Node" in res.headers
        # the same namespace: a semantic hit is served (the check is not "never")
        same = body_of("When do we launch?", system="You are the assistant of team A.")
        hit = post(edge, same)
        assert hit.headers["X-Cache-Status"] == "HIT"
        assert hit.headers["X-Cache-Match"] == "semantic"
    finally:
        stack.embedder.key = None


def _short_name(i: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out = ""
    while True:
        i, d = divmod(i, 62)
        out = digits[d] + out
        if i == 0:
            return out


def test_body_with_many_members_bypasses_the_cache_and_spares_the_worker(stack, edge_factory) -> None:
    """99,990 distinct fields in 0.8 MB: under edge.max_json_members and
    cache.max_request_bytes, so the node answers it, but over cache.max_request_members:
    it bypasses the cache (no key worked out, nothing stored, the reason in the error
    log) while another client's requests on the same (only) worker go on."""
    edge = edge_factory(settings(stack))
    fields = {"x" + _short_name(i): 0 for i in range(99990)}
    big_body = {"model": MODEL, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "many fields"}], **fields}
    big = json.dumps(big_body, separators=(",", ":"))
    assert 700_000 < len(big) < Settings().cache.max_request_bytes
    assert 99990 < Settings().edge.max_json_members
    latencies: list[float] = []
    codes: list[int] = []
    done = threading.Event()

    def other_client() -> None:
        with requests.Session() as s:
            i = 0
            while not done.is_set() or i < 3:
                t0 = time.monotonic()
                res = s.post(edge.url + CHAT, json=body_of(f"other client {i % 3}", max_tokens=2),
                             timeout=30)
                latencies.append(time.monotonic() - t0)
                codes.append(res.status_code)
                i += 1

    t = threading.Thread(target=other_client)
    t.start()
    try:
        res = post(edge, big)
    finally:
        done.set()
        t.join(60)
    assert res.status_code == 200, res.text[:300]
    assert res.headers["X-Cache-Status"] == "BYPASS"
    assert "bypasses the cache (cache.max_request_members" in edge.error_log()
    assert not stack.r.exists(keynames.cache_entry(keys_for(CHAT, big_body, "default").exact))
    assert codes and set(codes) == {200}, codes
    assert max(latencies) < 1.0, f"another client waited {max(latencies):.2f}s"  # a guard only
    # a body just under the bound still takes part in the cache
    small = body_of("a few fields", metadata={_short_name(i): 0 for i in range(100)})
    assert post(edge, small).headers["X-Cache-Status"] == "MISS"


def test_member_limit_of_the_cache_is_configurable(stack, edge_factory) -> None:
    edge = edge_factory(settings(stack, max_request_members=50))
    under = body_of("members under", metadata={"tags": list(range(30))})
    over = body_of("members over", metadata={"tags": list(range(60))})
    assert post(edge, under).headers["X-Cache-Status"] == "MISS"
    stored(stack, under)
    assert post(edge, under).headers["X-Cache-Status"] == "HIT"
    assert post(edge, over).headers["X-Cache-Status"] == "BYPASS"
    time.sleep(0.3)
    assert post(edge, over).headers["X-Cache-Status"] == "BYPASS"
    assert not stack.r.exists(keynames.cache_entry(keys_for(CHAT, over, "default").exact))
