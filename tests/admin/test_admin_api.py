"""The admin JSON API (/api/v1) against a real redis-server, through Flask's test client."""

from __future__ import annotations

import json
import time

import pytest

from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.redisdb import keynames
from controlplane.routing import keycopies, registry
from controlplane.admin import create_app
from controlplane.config import NodeSettings, Settings
from support.vectors import vector_keys, write_vectors

TOKEN = "test-admin-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_settings(token: str = TOKEN) -> Settings:
    return Settings.model_validate({"controlplane": {"admin_token": token},
                                    "edge": {"stale_after_s": 10.0}})


@pytest.fixture
def client(r):
    return create_app(make_settings(), r).test_client()


def add(r, name: str = "sim-a", port: int = 9001, **kw) -> NodeSettings:
    node = NodeSettings(name=name, url=f"http://127.0.0.1:{port}", **kw)
    registry.put_node(r, node)
    return node


def err(resp) -> dict:
    body = resp.get_json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "code"}, body
    return body["error"]


# ---- auth ----------------------------------------------------------------------------


def test_healthz_needs_no_auth(client):
    resp = client.get("/healthz")
    assert resp.status_code == 200
    assert resp.get_json() == {"ok": True, "instance_id": ""}


@pytest.mark.parametrize("headers,code", [
    ({}, "missing_admin_token"),
    ({"Authorization": "Bearer wrong"}, "invalid_admin_token"),
    ({"Authorization": f"Bearer {TOKEN}x"}, "invalid_admin_token"),
    ({"Authorization": f"Basic {TOKEN}"}, "missing_admin_token"),
])
def test_wrong_or_missing_token_is_401(client, r, headers, code):
    add(r)
    for method, path in [("get", "/api/v1/nodes"), ("post", "/api/v1/nodes/sim-a/drain"),
                         ("delete", "/api/v1/nodes/sim-a"), ("get", "/api/v1/keys")]:
        resp = getattr(client, method)(path, headers=headers)
        assert resp.status_code == 401, (method, path)
        e = err(resp)
        assert e["type"] == "authentication_error" and e["code"] == code
    assert registry.get_state(r, "sim-a").state == "active"
    assert registry.get_node(r, "sim-a") is not None


def test_empty_admin_token_refuses_every_call(r):
    c = create_app(make_settings(token=""), r).test_client()
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}):
        resp = c.get("/api/v1/nodes", headers=headers)
        assert resp.status_code == 403
        e = err(resp)
        assert e["code"] == "admin_token_unset"
        assert "INFERGATE_ADMIN_TOKEN" in e["message"]


def test_unknown_endpoint_and_method_are_json(client):
    resp = client.get("/api/v1/nope", headers=AUTH)
    assert resp.status_code == 404 and err(resp)["code"] == "unknown_endpoint"
    resp = client.put("/api/v1/nodes", headers=AUTH)
    assert resp.status_code == 405 and err(resp)["code"] == "method_not_allowed"


# ---- nodes ---------------------------------------------------------------------------


def test_list_nodes_merges_registry_state_metrics_and_fresh_edges(client, r):
    add(r, "sim-a", 9001, weight=2.0)
    add(r, "sim-b", 9002, kind="tgi")
    add(r, "sim-c", 9003, kind="openai")
    now = time.time()
    registry.set_state(r, "sim-c", "draining", "admin")
    r.set(keynames.node_metrics("sim-a"), json.dumps({
        "name": "sim-a", "ts": now - 2, "healthy": True, "reachable": True, "dialect": "vllm",
        "queue_depth": 4.0, "running": 7.0, "kv_cache_usage": 0.42, "e2e_avg_s": 1.8,
        "ttft_avg_s": 0.12, "score": 0.3, "saturated": False}))
    r.set(keynames.node_metrics("sim-b"), json.dumps({
        "name": "sim-b", "ts": now, "healthy": False, "reachable": False,
        "last_error": "connection refused"}))
    r.set(keynames.node_metrics("sim-c"), json.dumps({"name": "sim-c", "healthy": False}))
    for i in range(5):
        r.lpush(keynames.node_history("sim-a"), json.dumps({"ts": now - 5 + i, "queue_depth": i,
                                                        "e2e_avg_s": 1.0 + i}))
    r.lpush(keynames.node_history("sim-a"), json.dumps({"ts": now - 3600, "queue_depth": 99}))
    r.hset(keynames.EDGES, mapping={
        "edge-1": json.dumps({"edge_id": "edge-1", "ts": now, "nodes": {
            "sim-a": {"inflight": 2, "requests": 100, "failures": 3, "breaker": "closed",
                      "latency_ewma_ms": 800.0},
            "sim-b": {"inflight": 0, "requests": 10, "failures": 10, "breaker": "open"}}}),
        "edge-2": json.dumps({"edge_id": "edge-2", "ts": now - 1, "nodes": {
            "sim-a": {"inflight": 3, "requests": 100, "failures": 1, "breaker": "half_open",
                      "latency_ewma_ms": 1000.0}}}),
        # older than 3 x stale_after_s (30 s): ignored
        "edge-old": json.dumps({"edge_id": "edge-old", "ts": now - 31, "nodes": {
            "sim-a": {"inflight": 50, "requests": 1000, "failures": 1000, "breaker": "open"}}}),
        "edge-junk": "not json",
    })
    r.set(keynames.ROUTING, json.dumps({"version": 3, "generated_at": now, "nodes": [
        {"name": "sim-a", "effective_weight": 0.5}]}))

    resp = client.get("/api/v1/nodes?history=1", headers=AUTH)
    assert resp.status_code == 200
    nodes = {n["name"]: n for n in resp.get_json()["nodes"]}
    assert list(nodes) == ["sim-a", "sim-b", "sim-c"]
    a, b, c = nodes["sim-a"], nodes["sim-b"], nodes["sim-c"]
    assert a["state"] == "active" and a["status"] == "active" and a["healthy"] is True
    assert a["weight"] == 2.0 and a["effective_weight"] == 0.5
    assert a["queue_depth"] == 4.0 and a["running"] == 7.0 and a["kv_cache_usage"] == 0.42
    assert a["e2e_avg_s"] == 1.8 and a["ttft_avg_s"] == 0.12 and a["score"] == 0.3
    assert 1.5 < a["poll_age_s"] < 10
    assert a["inflight"] == 5 and a["requests"] == 200 and a["failures"] == 4
    assert a["error_rate"] == pytest.approx(0.02)
    assert a["breaker"] == "half_open"
    assert a["breakers"] == {"edge-1": "closed", "edge-2": "half_open"}
    assert a["edge_latency_ms"] == 900.0 and a["edges"] == 2
    assert a["history"]["queue_depth"] == [0, 1, 2, 3, 4]  # oldest first, old point dropped
    assert a["history"]["e2e_avg_s"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert b["status"] == "down" and b["healthy"] is False and b["breaker"] == "open"
    assert b["error_rate"] == 1.0 and b["last_error"] == "connection refused"
    assert c["state"] == "draining" and c["status"] == "draining" and c["healthy"] is False
    assert c["inflight"] == 0 and c["error_rate"] is None and c["poll_age_s"] is None

    plain = client.get("/api/v1/nodes", headers=AUTH).get_json()["nodes"]
    assert all(n["history"] is None for n in plain)


def test_get_node_and_unknown_node(client, r):
    add(r)
    registry.add_event(r, "health", "sim-a", "system", {"healthy": False})
    registry.add_event(r, "health", "sim-b", "system", {"healthy": False})
    resp = client.get("/api/v1/nodes/sim-a", headers=AUTH)
    assert resp.status_code == 200
    d = resp.get_json()
    assert d["name"] == "sim-a" and d["url"] == "http://127.0.0.1:9001"
    assert isinstance(d["history"], dict)
    assert [e["node"] for e in d["events"]] == ["sim-a"]
    resp = client.get("/api/v1/nodes/nope", headers=AUTH)
    assert resp.status_code == 404
    e = err(resp)
    assert e["type"] == "not_found_error" and "nope" in e["message"]


def test_add_node(client, r):
    body = {"name": "gpu-1", "url": "http://10.0.0.5:8000/", "kind": "sglang", "weight": 2.5,
            "max_concurrency": 128}
    resp = client.post("/api/v1/nodes", json=body, headers=AUTH)
    assert resp.status_code == 201
    assert resp.get_json()["url"] == "http://10.0.0.5:8000"
    node = registry.get_node(r, "gpu-1")
    assert node is not None and node.kind == "sglang" and node.weight == 2.5
    assert node.max_concurrency == 128
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "node_add" and ev["node"] == "gpu-1" and ev["actor"] == "admin@127.0.0.1 (api)"

    resp = client.post("/api/v1/nodes", json={**body, "weight": 1}, headers=AUTH)
    assert resp.status_code == 409
    assert err(resp)["code"] == "node_exists"
    assert registry.get_node(r, "gpu-1").weight == 2.5

    # the same server under another name (a drain of gpu-1 would not hold): refused
    for url in ("http://10.0.0.5:8000", "HTTP://10.0.0.5:8000/"):
        resp = client.post("/api/v1/nodes", json={"name": "gpu-1b", "url": url}, headers=AUTH)
        assert resp.status_code == 409 and err(resp)["code"] == "node_url_taken", url
        assert "'gpu-1'" in err(resp)["message"]
    assert registry.get_node(r, "gpu-1b") is None
    assert client.post("/api/v1/nodes", json={"name": "gpu-2", "url": "http://10.0.0.5:8001"},
                       headers=AUTH).status_code == 201
    resp = client.patch("/api/v1/nodes/gpu-2", json={"url": "http://10.0.0.5:8000"},
                        headers=AUTH)
    assert resp.status_code == 409 and err(resp)["code"] == "node_url_taken"
    assert registry.get_node(r, "gpu-2").url == "http://10.0.0.5:8001"


@pytest.mark.parametrize("body,field", [
    ({"name": "n1", "url": "ftp://10.0.0.5"}, "url"),
    ({"name": "n1", "url": "not a url"}, "url"),
    ({"name": "n1", "url": "http://10.0.0.5:8000/v1"}, "url"),
    ({"name": "n1", "url": "http://10.0.0.5:8000#frag"}, "url"),
    ({"name": "n1", "url": "http://10.0.0.5:8000/#"}, "url"),
    ({"name": "n1", "url": "http://10.0.0.5:99999"}, "url"),
    ({"name": "n1", "url": "http://10.0.0.5", "weight": 0}, "weight"),
    ({"name": "n1", "url": "http://10.0.0.5", "weight": -1}, "weight"),
    ({"name": "n1", "url": "http://10.0.0.5", "weight": "heavy"}, "weight"),
    ({"name": "n1", "url": "http://10.0.0.5", "weight": "1_000"}, "weight"),
    ({"name": "n1", "url": "http://10.0.0.5", "health_path": "/" + "h" * 10_000},
     "health_path"),
    ({"name": "n1", "url": "http://10.0.0.5", "kind": "llamacpp"}, "kind"),
    ({"name": "n1", "url": "http://10.0.0.5", "max_concurrency": 0}, "max_concurrency"),
    ({"name": "n1", "url": "http://10.0.0.5", "max_concurrency": True}, "max_concurrency"),
    ({"name": "n1", "url": "http://10.0.0.5", "weight": True}, "weight"),
    ({"name": "bad name!", "url": "http://10.0.0.5"}, "name"),
    ({"name": "../x", "url": "http://10.0.0.5"}, "name"),
    ({"url": "http://10.0.0.5"}, "name"),
    ({"name": "n1", "url": "http://10.0.0.5", "colour": "red"}, "colour"),
])
def test_add_node_rejects_bad_input(client, r, body, field):
    resp = client.post("/api/v1/nodes", json=body, headers=AUTH)
    assert resp.status_code == 400
    e = err(resp)
    assert e["type"] == "invalid_request_error"
    assert e["message"].startswith(field), e["message"]
    assert registry.list_nodes(r) == []


@pytest.mark.parametrize("data", ["", "{nope", "[1, 2]", "null", "[" * 100_000 + "]" * 100_000])
def test_add_node_rejects_non_object_body(client, r, data):
    resp = client.post("/api/v1/nodes", data=data, headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 400
    assert err(resp)["code"] == "invalid_json"


def test_edit_node(client, r):
    add(r, "sim-a", 9001)
    resp = client.patch("/api/v1/nodes/sim-a", json={"weight": 3, "kind": "tgi"}, headers=AUTH)
    assert resp.status_code == 200
    d = resp.get_json()
    assert d["weight"] == 3.0 and d["kind"] == "tgi" and d["url"] == "http://127.0.0.1:9001"
    assert registry.get_node(r, "sim-a").weight == 3.0
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "node_edit" and ev["actor"] == "admin@127.0.0.1 (api)"
    assert ev["detail"] == {"kind": ["vllm", "tgi"], "weight": [1.0, 3.0]}

    for body, frag in [({"weight": 0}, "weight"), ({"url": "https://x"}, "url"),
                       ({"url": "http://127.0.0.1:9001#x"}, "without a path, query or fragment"),
                       ({"name": "other"}, "name"), ({"port": 1}, "unknown field"), ({}, "expected"),
                       ({"max_concurrency": True}, "max_concurrency: Input should be a valid integer")]:
        resp = client.patch("/api/v1/nodes/sim-a", json=body, headers=AUTH)
        assert resp.status_code == 400, body
        assert frag in err(resp)["message"]
    assert registry.get_node(r, "sim-a").weight == 3.0
    resp = client.patch("/api/v1/nodes/nope", json={"weight": 2}, headers=AUTH)
    assert resp.status_code == 404


def test_delete_node(client, r):
    add(r)
    registry.set_state(r, "sim-a", "draining")
    r.set(keynames.node_metrics("sim-a"), "{}")
    resp = client.delete("/api/v1/nodes/sim-a", headers=AUTH)
    assert resp.status_code == 200 and resp.get_json() == {"deleted": "sim-a"}
    assert registry.get_node(r, "sim-a") is None
    assert r.hget(keynames.NODE_STATES, "sim-a") is None and not r.exists(keynames.node_metrics("sim-a"))
    assert registry.recent_events(r, 1)[0]["kind"] == "node_remove"
    assert client.delete("/api/v1/nodes/sim-a", headers=AUTH).status_code == 404


def test_drain_and_undrain(client, r):
    add(r)
    resp = client.post("/api/v1/nodes/sim-a/drain", headers=AUTH)
    assert resp.status_code == 200
    d = resp.get_json()
    assert d["state"] == "draining" and d["changed"] is True and d["actor"] == "admin@127.0.0.1 (api)"
    st = registry.get_state(r, "sim-a")
    assert st.state == "draining" and abs(st.since - time.time()) < 5

    # idempotent: same state, same since, no second event
    again = client.post("/api/v1/nodes/sim-a/drain", headers=AUTH)
    assert again.status_code == 200
    assert again.get_json()["changed"] is False and again.get_json()["since"] == d["since"]
    assert [e["kind"] for e in registry.recent_events(r, 10)] == ["drain"]

    # the control plane marks it drained; draining again keeps it drained
    registry.set_state(r, "sim-a", "drained", "cp")
    assert client.post("/api/v1/nodes/sim-a/drain", headers=AUTH).get_json()["state"] == "drained"

    resp = client.post("/api/v1/nodes/sim-a/undrain", headers=AUTH)
    assert resp.status_code == 200
    u = resp.get_json()
    assert u["state"] == "active" and u["changed"] is True and u["since"] > d["since"]
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "undrain" and ev["actor"] == "admin@127.0.0.1 (api)" and ev["detail"] == {"from": "drained"}
    assert client.post("/api/v1/nodes/sim-a/undrain", headers=AUTH).get_json()["changed"] is False

    for path in ("/api/v1/nodes/nope/drain", "/api/v1/nodes/nope/undrain"):
        resp = client.post(path, headers=AUTH)
        assert resp.status_code == 404 and err(resp)["code"] == "node_not_found"
    assert r.hget(keynames.NODE_STATES, "nope") is None


# ---- events, snapshot ------------------------------------------------------------------


def test_events(client, r):
    for i in range(5):
        registry.add_event(r, "health", "sim-a" if i % 2 else "sim-b", "system", {"i": i})
    resp = client.get("/api/v1/events?limit=3", headers=AUTH)
    assert resp.status_code == 200
    evs = resp.get_json()["events"]
    assert [e["detail"]["i"] for e in evs] == [4, 3, 2]
    assert set(evs[0]) == {"id", "ts", "kind", "node", "actor", "detail"}
    evs = client.get("/api/v1/events?node=sim-a", headers=AUTH).get_json()["events"]
    assert [e["detail"]["i"] for e in evs] == [3, 1]
    for bad in ("0", "1001", "x"):
        resp = client.get(f"/api/v1/events?limit={bad}", headers=AUTH)
        assert resp.status_code == 400 and "limit" in err(resp)["message"]


def test_snapshot(client, r):
    resp = client.get("/api/v1/snapshot", headers=AUTH)
    assert resp.status_code == 404 and err(resp)["code"] == "no_snapshot"
    snap = {"version": 7, "generated_at": 1.5, "leader": "cp-1", "nodes": [{"name": "sim-a"}]}
    r.set(keynames.ROUTING, json.dumps(snap))
    resp = client.get("/api/v1/snapshot", headers=AUTH)
    assert resp.status_code == 200 and resp.get_json() == snap


# ---- cache ---------------------------------------------------------------------------


def _fill_cache(r) -> None:
    for i in range(6):
        cache_store.store(r, f"{i:032x}", tenant="t1" if i < 4 else "t2",
                          model="m-a" if i % 2 else "m-b", namespace="ns", body="x" * 100, ttl=300)


def test_cache_stats(client, r):
    r.hset(keynames.CACHE_STATS, mapping={"lookups": 10, "hits_exact": 3, "hits_semantic": 2,
                                      "misses": 5, "bypass": 1})
    _fill_cache(r)
    resp = client.get("/api/v1/cache/stats", headers=AUTH)
    assert resp.status_code == 200
    d = resp.get_json()
    assert d["entries"] == 6 and d["stores"] == 6 and d["lookups"] == 10
    assert d["hit_rate"] == 0.5 and d["hit_rate_exact"] == 0.3 and d["hit_rate_semantic"] == 0.2
    assert d["memory_bytes"] > 600 and d["redis_used_memory"] > 0


def test_cache_purge(client, r):
    _fill_cache(r)
    resp = client.post("/api/v1/cache/purge", json={"tenant": "t1", "model": "m-a"}, headers=AUTH)
    assert resp.status_code == 200
    assert resp.get_json() == {"purged": 2, "scope": {"tenant": "t1", "model": "m-a"}}
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "cache_purge" and ev["actor"] == "admin@127.0.0.1 (api)" and ev["detail"]["purged"] == 2
    assert client.post("/api/v1/cache/purge", json={"tenant": "t2"}, headers=AUTH).get_json()["purged"] == 2
    assert client.post("/api/v1/cache/purge", json={"all": True}, headers=AUTH).get_json()["purged"] == 2
    assert cache_store.stats(r).entries == 0

    for body, frag in [({}, "scope"), ({"all": False}, "all"), ({"all": True, "tenant": "t"}, "all"),
                       ({"tenant": ""}, "tenant"), ({"tenant": 5}, "tenant"), ({"user": "x"}, "unknown")]:
        resp = client.post("/api/v1/cache/purge", json=body, headers=AUTH)
        assert resp.status_code == 400, body
        assert frag in err(resp)["message"]


def test_cache_purge_deletes_the_vectors_of_the_purged_entries(client, r):
    pytest.importorskip("numpy")
    _fill_cache(r)
    keys = [f"{i:032x}" for i in range(6)]
    vec_a = write_vectors(r, keys, "model-a", 4)
    vec_b = write_vectors(r, keys[:2], "model-b", 8)  # a second embedding model
    assert vector_keys(r) == set(vec_a + vec_b)
    resp = client.post("/api/v1/cache/purge", json={"tenant": "t1", "model": "m-a"}, headers=AUTH)
    assert resp.get_json()["purged"] == 2  # entries 1 and 3
    assert vector_keys(r) == set(vec_a + vec_b) - {vec_a[1], vec_a[3], vec_b[1]}
    assert registry.recent_events(r, 1)[0]["detail"] == {"tenant": "t1", "model": "m-a",
                                                         "purged": 2}
    assert client.post("/api/v1/cache/purge", json={"tenant": "nobody"},
                       headers=AUTH).get_json()["purged"] == 0
    assert len(vector_keys(r)) == 5
    assert client.post("/api/v1/cache/purge", json={"all": True}, headers=AUTH).get_json()["purged"] == 4
    assert vector_keys(r) == set()


# ---- keys ----------------------------------------------------------------------------


def test_api_keys_lifecycle(client, r):
    resp = client.post("/api/v1/keys", json={"tenant": "acme", "rpm": 60, "label": "ci"},
                       headers=AUTH)
    assert resp.status_code == 201
    d = resp.get_json()
    key = d["key"]
    assert key.startswith("ig-") and len(key) > 40
    assert d["tenant"] == "acme" and d["rpm"] == 60 and d["tpm"] is None and d["revoked"] is None
    assert apikeys.lookup(r, key).tenant == "acme"
    assert key not in json.dumps(r.hgetall(keynames.APIKEYS))  # stored hashed only

    listed = client.get("/api/v1/keys", headers=AUTH).get_json()["keys"]
    assert [k["id"] for k in listed] == [d["id"]]
    assert "key" not in listed[0] and key not in json.dumps(listed)

    resp = client.patch(f"/api/v1/keys/{d['id']}", json={"tpm": 10000, "rpm": None}, headers=AUTH)
    assert resp.status_code == 200
    assert resp.get_json()["tpm"] == 10000 and resp.get_json()["rpm"] is None
    assert apikeys.lookup(r, key).tpm == 10000

    # a running control plane whose copy of the state is ahead of the revocation
    keycopies.report(r, "cp-1", keycopies.current_gen(r) + 5, every_s=1.0)
    resp = client.delete(f"/api/v1/keys/{d['id']}", headers=AUTH)
    assert resp.status_code == 200 and resp.get_json()["revoked"] is not None
    assert resp.headers["X-Infergate-State-Copied"] == "yes"
    assert apikeys.lookup(r, key) is None
    again = client.delete(f"/api/v1/keys/{d['id']}", headers=AUTH)
    assert again.status_code == 200 and again.headers["X-Infergate-State-Copied"] == "none"
    # a revoked key does not change (409), and no event says it did
    resp = client.patch(f"/api/v1/keys/{d['id']}", json={"rpm": 5}, headers=AUTH)
    assert resp.status_code == 409 and resp.get_json()["error"]["code"] == "key_revoked"
    assert apikeys.get_key(r, d["id"]).rpm is None
    kinds = [e["kind"] for e in registry.recent_events(r, 10)]
    assert kinds == ["key_revoke", "key_edit", "key_create"]

    assert client.delete("/api/v1/keys/deadbeef", headers=AUTH).status_code == 404
    assert client.patch("/api/v1/keys/deadbeef", json={"rpm": 1}, headers=AUTH).status_code == 404


def test_api_keys_fair_share_is_set_and_reset(client, r):
    resp = client.post("/api/v1/keys", json={"tenant": "acme", "weight": 2.5,
                                             "priority": "critical"}, headers=AUTH)
    assert resp.status_code == 201
    d = resp.get_json()
    assert d["weight"] == 2.5 and d["priority"] == "critical"
    resp = client.patch(f"/api/v1/keys/{d['id']}", json={"weight": None, "priority": "sheddable"},
                        headers=AUTH)
    assert resp.status_code == 200
    rec = apikeys.get_key(r, d["id"])
    assert rec.weight is None and rec.priority == "sheddable"   # None: the tenant's default
    resp = client.patch(f"/api/v1/keys/{d['id']}", json={"priority": "top"}, headers=AUTH)
    assert resp.status_code == 400 and "priority" in err(resp)["message"]


@pytest.mark.parametrize("body,frag", [
    ({}, "tenant"), ({"tenant": "a b"}, "tenant"), ({"tenant": "t", "rpm": 0}, "rpm"),
    ({"tenant": "t", "rpm": "many"}, "rpm"), ({"tenant": "t", "tpm": 1.5}, "tpm"),
    ({"tenant": "t", "rpm": True}, "rpm"), ({"tenant": "t", "secret": "x"}, "unknown"),
    ({"tenant": "t", "weight": 0}, "weight"), ({"tenant": "t", "weight": "heavy"}, "weight"),
    ({"tenant": "t", "weight": "1_000"}, "weight"),
    ({"tenant": "t", "priority": "urgent"}, "priority"),
])
def test_api_keys_bad_input(client, r, body, frag):
    resp = client.post("/api/v1/keys", json=body, headers=AUTH)
    assert resp.status_code == 400
    assert frag in err(resp)["message"]
    assert apikeys.list_keys(r) == []


def test_redis_down_is_503(redis_server):
    client = create_app(make_settings(), redis_server.client()).test_client()
    assert client.get("/api/v1/nodes", headers=AUTH).status_code == 200
    redis_server.stop()
    resp = client.get("/api/v1/nodes", headers=AUTH)
    assert resp.status_code == 503
    assert err(resp)["code"] == "redis_unavailable"
    assert client.get("/healthz").status_code == 200


def test_cache_namespaces_and_flag(client, r):
    ns, key = "cd" * 32, "ab" * 32
    cache_store.store(r, key, tenant="acme", model="m", namespace=ns, body="hello", ttl=300)
    r.hset(keynames.cache_ns_stats(ns), mapping={"hits_exact": 4, "hits_semantic": 6,
                                                 "verified": 10, "wrong": 1})
    r.hset(keynames.CACHE_THRESHOLD_RAISE, ns, "0.02")
    resp = client.get("/api/v1/cache", headers=AUTH)
    assert resp.status_code == 200
    body = resp.get_json()
    assert set(body) == {"stats", "namespaces", "verify"}
    row = body["namespaces"][0]
    assert (row["namespace"], row["hits_exact"], row["hits_semantic"]) == (ns, 4, 6)
    assert row["wrong_rate"] == 0.1 and 0.1 < row["wrong_rate_upper"] < 0.5
    assert row["threshold_raise"] == 0.02
    assert client.get("/api/v1/cache?limit=0", headers=AUTH).status_code == 400
    flag = client.post(f"/api/v1/cache/entries/{key.upper()}/flag", headers=AUTH)
    assert flag.status_code == 200
    assert flag.get_json() == {"id": key, "namespace": ns, "dropped": True, "flagged": 1}
    assert not r.exists(keynames.cache_entry(key)) and 0 < r.pttl(keynames.cache_dropped(key))
    assert client.post(f"/api/v1/cache/entries/{key}/flag", headers=AUTH).get_json()["dropped"] is False
    assert r.hget(keynames.cache_ns_stats(ns), "flagged") == "1"
    for bad in ("nothex", "0" * 64):
        e = client.post(f"/api/v1/cache/entries/{bad}/flag", headers=AUTH)
        assert e.status_code == 404 and err(e)["code"] == "entry_not_found"


def test_draining_the_last_active_node_of_a_model_is_accepted_with_a_warning(client, r):
    """Models as configured or, for a node without, as the routing snapshot lists them
    (read from its /v1/models); a node whose models are unknown takes any model."""
    add(r, "a", 9001, models=["llama"])
    add(r, "b", 9002)                          # its models: from the snapshot
    add(r, "c", 9003, models=["llama"])
    r.set(keynames.ROUTING, json.dumps({"version": 1, "generated_at": time.time(), "nodes": [
        {"name": "a", "models": ["llama"]}, {"name": "b", "models": ["qwen", "llama"]},
        {"name": "c", "models": ["llama"]}]}))
    resp = client.post("/api/v1/nodes/a/drain", headers=AUTH)
    assert resp.status_code == 200 and resp.get_json()["warning"] == ""
    resp = client.post("/api/v1/nodes/b/drain", headers=AUTH)
    assert resp.status_code == 200
    d = resp.get_json()
    assert d["state"] == "draining" and d["changed"] is True
    assert d["warning"] == ("no active node is left for model(s) qwen: requests for it will "
                            "get 503 no_healthy_upstream until a node serving it is "
                            "undrained or added")
    assert registry.get_state(r, "b").state == "draining"
    resp = client.post("/api/v1/nodes/c/drain", headers=AUTH)
    assert resp.get_json()["warning"].startswith("no active node is left: every request "
                                                 "will get 503 no_healthy_upstream")
    assert client.post("/api/v1/nodes/c/undrain", headers=AUTH).get_json()["warning"] == ""
    # a node whose models are unknown may be sent any model: no warning
    add(r, "d", 9004)
    assert client.post("/api/v1/nodes/c/drain", headers=AUTH).get_json()["warning"] == ""


def test_an_edit_that_changes_nothing_writes_no_event(client, r):
    add(r, "sim-a", 9001, weight=2)
    resp = client.patch("/api/v1/nodes/sim-a", json={"weight": 2, "url": "http://127.0.0.1:9001/"},
                        headers=AUTH)
    assert resp.status_code == 200 and resp.get_json()["weight"] == 2.0
    assert registry.recent_events(r, 5) == []
    resp = client.patch("/api/v1/nodes/sim-a", json={"weight": 3}, headers=AUTH)
    assert [e["detail"] for e in registry.recent_events(r, 5)] == [{"weight": [2.0, 3.0]}]


def test_a_name_equal_to_another_but_for_case_is_refused(client, r):
    assert client.post("/api/v1/nodes", json={"name": "sim-fast", "url": "http://10.0.0.5:8000"},
                       headers=AUTH).status_code == 201
    resp = client.post("/api/v1/nodes", json={"name": "SIM-FAST", "url": "http://10.0.0.6:8000"},
                       headers=AUTH)
    assert resp.status_code == 409 and err(resp)["code"] == "node_exists"
    assert "'sim-fast' already exists" in err(resp)["message"]
    assert [n.name for n in registry.list_nodes(r)] == ["sim-fast"]


@pytest.mark.parametrize("url", ["http://" + "a" * 5000 + ":8000",
                                 "http://" + "é" * 5000 + ":8000"])
def test_a_huge_url_is_not_echoed_whole(client, r, url):
    resp = client.post("/api/v1/nodes", json={"name": "n1", "url": url}, headers=AUTH)
    assert resp.status_code == 400
    msg = err(resp)["message"]
    assert len(msg) < 500 and "characters)" in msg, msg[:300]
    resp = client.patch("/api/v1/nodes/" + "x" * 5000, json={"weight": 2}, headers=AUTH)
    assert resp.status_code == 404 and len(err(resp)["message"]) < 500


def test_a_node_added_under_a_name_with_a_state_left_behind_starts_active(client, r):
    """A state an older removal left (written before removals took it with the entry)
    does not make a new node of that name drained."""
    registry.set_state(r, "zz", "drained", "old")
    resp = client.post("/api/v1/nodes", json={"name": "zz", "url": "http://10.0.0.5:8000"},
                       headers=AUTH)
    assert resp.status_code == 201
    assert r.hget(keynames.NODE_STATES, "zz") is None
    assert registry.get_state(r, "zz").state == "active"
