"""Cache entry ids, flagging a wrong answer and the online verification of semantic
hits, end to end: real nginx edge, redis-server, the embedder, a simulated node, the
admin API and (for the verification) a control plane whose only node answers
differently from the one that filled the cache."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from controlplane import procs
from controlplane.admin import create_app
from controlplane.cache import store as cache_store
from controlplane.cache.key import keys_for
from controlplane.config import Settings, settings_from_dict
from controlplane.redisdb import keynames
from controlplane.routing import registry
from support.stack import edge_settings, start_cache_backend

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
MODEL = "sim-llama"
TOKEN = "verify-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Stack:
    dir: Path
    redis_url: str
    embedder_url: str
    r: redis.Redis


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    d = Path(tempfile.mkdtemp(prefix="infergate-verify-"))
    d.chmod(0o755)
    ps = procs.ProcessSet()
    try:
        url, _, embedder_url, r = start_cache_backend(d, ps)
        yield Stack(d, url, embedder_url, r)
    finally:
        ps.stop_all()
        shutil.rmtree(d, ignore_errors=True)


def cache_settings(stack: Stack, nodes: list, **cache: Any) -> Settings:
    s = edge_settings(stack.redis_url, nodes)
    c = {"enabled": True, "embedder_url": stack.embedder_url, "semantic_budget_ms": 3000,
         "min_similarity": 0.8, "verify_fraction": 0.0}
    c.update(cache)
    s.cache = s.cache.model_validate(c)
    return s


def body_of(content: str, **params: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0, **params}


def post(edge, body: dict) -> requests.Response:
    return requests.post(edge.url + CHAT, json=body, timeout=30)


def exact_key(body: dict) -> str:
    return keys_for(CHAT, body, "default").exact


def namespace_of(body: dict) -> str:
    return keys_for(CHAT, body, "default").namespace


def wait_stored(stack: Stack, body: dict) -> None:
    k = keynames.cache_entry(exact_key(body))
    procs.wait_until(lambda: stack.r.exists(k), 10, what=f"cache entry {k}")


def wait_indexed(stack: Stack, body: dict) -> None:
    key = exact_key(body)
    procs.wait_until(lambda: any(True for _ in stack.r.scan_iter(
        match=f"{keynames.CACHE_VEC_PREFIX}*:{key}", count=1000)), 20,
        what="semantic vector of the entry")


def ns_figure(stack: Stack, ns: str, field: str) -> int:
    return int(stack.r.hget(keynames.cache_ns_stats(ns), field) or 0)


@pytest.fixture
def admin(stack):
    s = Settings.model_validate({"controlplane": {"admin_token": TOKEN}})
    return create_app(s, stack.r).test_client()


def test_every_hit_names_its_entry_and_a_flag_drops_it(stack, simnodes, edge_factory,
                                                        admin) -> None:
    node = simnodes(1, time_scale=0.05)[0]
    edge = edge_factory(cache_settings(stack, [node.node_settings()]))
    body = body_of("What is the tallest mountain on Earth?")
    first = post(edge, body)
    assert first.headers["X-Cache-Status"] == "MISS" and "X-Cache-Entry" not in first.headers
    wait_stored(stack, body)
    key, ns = exact_key(body), namespace_of(body)

    hit = post(edge, body)
    assert hit.headers["X-Cache-Status"] == "HIT" and hit.headers["X-Cache-Entry"] == key
    streamed = requests.post(edge.url + CHAT, json={**body, "stream": True}, timeout=30)
    assert streamed.headers["X-Cache-Status"] == "HIT"
    assert streamed.headers["X-Cache-Entry"] == key
    assert streamed.text.rstrip().endswith("data: [DONE]")
    procs.wait_until(lambda: ns_figure(stack, ns, "hits_exact") >= 2, 10,
                     what="per-namespace exact hits")
    assert stack.r.ttl(keynames.cache_ns_stats(ns)) > 0

    wait_indexed(stack, body)
    res = admin.post(f"/api/v1/cache/entries/{key}/flag", headers=AUTH)
    assert res.status_code == 200, res.get_json()
    assert res.get_json() == {"id": key, "namespace": ns, "dropped": True, "flagged": 1}
    assert not stack.r.exists(keynames.cache_entry(key))
    assert not any(True for _ in stack.r.scan_iter(match=f"{keynames.CACHE_VEC_PREFIX}*:{key}"))
    # idempotent: the second flag changes and counts nothing
    again = admin.post(f"/api/v1/cache/entries/{key}/flag", headers=AUTH)
    assert again.status_code == 200 and again.get_json()["dropped"] is False
    assert ns_figure(stack, ns, "flagged") == 1
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"

    view = admin.get("/api/v1/cache", headers=AUTH).get_json()
    row = next(n for n in view["namespaces"] if n["namespace"] == ns)
    assert row["flagged"] == 1 and row["hits_exact"] >= 2 and row["wrong_rate"] is None
    assert view["verify"]["fraction"] == 0.02

    missing = admin.post("/api/v1/cache/entries/" + "0" * 64 + "/flag", headers=AUTH)
    assert missing.status_code == 404
    assert missing.get_json()["error"]["code"] == "entry_not_found"
    assert admin.post(f"/api/v1/cache/entries/{key}/flag").status_code == 401


def test_a_semantic_hit_answered_differently_is_verified_wrong_and_raises_the_threshold(
        stack, simnodes, tiny_upstreams, edge_factory, controlplane_factory) -> None:
    node = simnodes(1, time_scale=0.05)[0]
    edge = edge_factory(cache_settings(stack, [node.node_settings()], verify_fraction=1.0))
    body = body_of("How do I reset my password?")
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    wait_indexed(stack, body)
    key, ns = exact_key(body), namespace_of(body)

    # the control plane's only node answers something else entirely
    other = tiny_upstreams(names=["other-answers"])[0]
    cp_settings = settings_from_dict({
        "redis": {"url": stack.redis_url},
        "controlplane": {"poll_interval_s": 0.2, "poll_timeout_s": 0.5, "leader_ttl_s": 1.0,
                         "admin_token": TOKEN},
        "cache": {"enabled": True, "embedder_url": stack.embedder_url},
        "nodes": [other.node_settings(kind="openai").model_dump()]})
    try:
        controlplane_factory(cp_settings)
        para = body_of("How can I reset my password?")
        hit = post(edge, para)
        assert hit.headers["X-Cache-Status"] == "HIT", hit.headers
        assert hit.headers["X-Cache-Match"] == "semantic"
        assert hit.headers["X-Cache-Entry"] == key
        # the verdict is counted, then the threshold moves (a second write)
        procs.wait_until(lambda: ns_figure(stack, ns, "wrong") >= 1
                         and stack.r.hexists(keynames.CACHE_THRESHOLD_RAISE, ns), 20,
                         what="the semantic hit verified as wrong and the threshold raised")
        assert ns_figure(stack, ns, "verified") == 1
        assert ns_figure(stack, ns, "hits_semantic") >= 1
        assert ns_figure(stack, ns, "verify_queued") >= 1
        sent = json.loads(other.bodies[-1])
        assert sent["stream"] is False
        assert sent["messages"][-1]["content"] == "How can I reset my password?"
        raises = cache_store.threshold_raises(stack.r)
        assert raises == {ns: pytest.approx(0.01)}
        assert stack.r.ttl(keynames.CACHE_THRESHOLD_RAISE) > 0
        assert not stack.r.exists(keynames.cache_entry(key))  # a wrong verdict drops it
        figures = cache_store.namespace_stats(stack.r)
        row = next(n for n in figures if n.namespace == ns)
        assert row.wrong_rate == 1.0 and row.wrong_rate_upper == pytest.approx(1.0, abs=1e-3)

        # the embedder applies the raise to the threshold that decides a hit
        def raised() -> bool:
            res = requests.post(stack.embedder_url + "/v1/lookup",
                                json={"namespace": ns, "text": "anything"}, timeout=10).json()
            base = requests.post(stack.embedder_url + "/v1/lookup",
                                 json={"namespace": "e" * 64, "text": "anything"},
                                 timeout=10).json()
            key_ = "min_verifier_score" if base["min_verifier_score"] is not None \
                else "min_similarity"
            return res[key_] == pytest.approx(min(1.0, base[key_] + 0.01))

        procs.wait_until(raised, 10, what="the embedder to apply the raised threshold")
        moves = [e["detail"] for e in registry.recent_events(stack.r, 50)
                 if e["kind"] == "cache_threshold"]
        assert moves and moves[0]["namespace"] == ns and moves[0]["to"] == pytest.approx(0.01)
    finally:
        # the module's Redis serves the next tests without this control plane's state
        stack.r.delete(keynames.ROUTING, keynames.ROUTING_VERSION, keynames.NODES,
                       keynames.NODE_STATES, keynames.LEADER)
