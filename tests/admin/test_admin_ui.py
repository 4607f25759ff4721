"""The admin web page: login, sessions, CSRF, pages and forms (real redis-server, Flask
test client)."""

from __future__ import annotations

import json
import re
import time

import pytest

from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.routing.service import make_client
from controlplane.admin import create_app
from controlplane.config import NodeSettings, Settings
from support.vectors import vector_keys, write_vectors

TOKEN = "ui-admin-token-456"


def make_app(r, token: str = TOKEN):
    s = Settings.model_validate({"controlplane": {"admin_token": token}})
    return create_app(s, r, secret_key="fixed-test-secret")


@pytest.fixture
def app(r):
    return make_app(r)


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF field in the page"
    return m.group(1)


def login(c) -> str:
    page = c.get("/login")
    assert page.status_code == 200
    resp = c.post("/login", data={"token": TOKEN, "csrf_token": csrf_of(page.text)})
    assert resp.status_code == 303, resp.text
    return csrf_of(c.get("/nodes").text)


@pytest.fixture
def client(app, r):
    registry.put_node(r, NodeSettings(name="sim-a", url="http://127.0.0.1:9001"))
    registry.put_node(r, NodeSettings(name="sim-b", url="http://127.0.0.1:9002", kind="tgi"))
    c = app.test_client()
    c.csrf = login(c)
    return c


def test_pages_need_login(app):
    c = app.test_client()
    for path in ("/", "/nodes", "/nodes/sim-a", "/events", "/cache", "/keys"):
        resp = c.get(path)
        assert resp.status_code == 302, path
        assert "/login" in resp.location
    resp = c.post("/nodes/sim-a/drain", data={})
    assert resp.status_code in (400, 401)


def test_login_wrong_token_and_missing_csrf(app):
    c = app.test_client()
    page = c.get("/login?next=/events")
    tok = csrf_of(page.text)
    resp = c.post("/login", data={"token": "nope", "csrf_token": tok, "next": "/events"})
    assert resp.status_code == 303 and "/login?next=" in resp.location  # post/redirect/get
    page = c.get(resp.location)
    assert "Wrong admin token" in page.text and 'value="/events"' in page.text
    assert "Wrong admin token" not in c.get("/login").text  # shown once
    resp = c.post("/login", data={"token": TOKEN})
    assert resp.status_code == 400 and "CSRF" in resp.text
    assert c.get("/nodes").status_code == 302
    resp = c.post("/login", data={"token": TOKEN, "csrf_token": tok, "next": "/events"})
    assert resp.status_code == 303 and resp.location.endswith("/events")
    assert c.get("/nodes").status_code == 200


def test_login_never_redirects_off_site(app):
    c = app.test_client()
    for target in ("https://evil.example/", "//evil.example/x", "/\\evil.example",
                   "http://[::1", "//[evil"):
        tok = csrf_of(c.get("/login").text)
        resp = c.post("/login", data={"token": TOKEN, "csrf_token": tok, "next": target})
        assert resp.status_code == 303 and resp.location == "/", target
        c.post("/logout", data={"csrf_token": csrf_of(c.get("/nodes").text)})


def test_a_target_urlsplit_cannot_read_is_not_a_500(client, r):
    """next / back holding an unbalanced IPv6 bracket ("http://[::1") made urlsplit raise:
    a correct login, a logged-in /login and a drain form answered 500 (the login and the
    drain done all the same). They go to the overview or the nodes page instead."""
    resp = client.get("/login?next=http://[::1")
    assert resp.status_code == 302 and resp.location == "/"
    r.hset(keynames.NODES, "gpu-a", NodeSettings(name="gpu-a", url="http://127.0.0.1:9001")
           .model_dump_json())
    for back in ("http://[::1", "/[::1]"):
        resp = client.post("/nodes/gpu-a/drain", data={"csrf_token": client.csrf, "back": back})
        assert resp.status_code == 303, back
    assert registry.get_state(r, "gpu-a").state in ("draining", "drained")


def test_session_cookie_flags(app):
    c = app.test_client()
    page = c.get("/login")
    resp = c.post("/login", data={"token": TOKEN, "csrf_token": csrf_of(page.text)})
    cookie = resp.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie


def test_empty_token_refuses_logins(r):
    c = make_app(r, token="").test_client()
    page = c.get("/login")
    assert page.status_code == 403
    assert "Admin access is disabled" in page.text and "INFERGATE_ADMIN_TOKEN" in page.text
    assert 'name="token"' not in page.text
    tok = re.search(r'name="csrf-token" content="([^"]+)"', page.text).group(1)
    for token in ("", "anything"):
        resp = c.post("/login", data={"token": token, "csrf_token": tok})
        assert resp.status_code == 403 and "Admin access is disabled" in resp.text
    assert c.get("/nodes").status_code == 302


def test_changing_the_token_ends_sessions(r):
    settings = Settings.model_validate({"controlplane": {"admin_token": TOKEN}})
    app = create_app(settings, r, secret_key="fixed")
    c = app.test_client()
    tok = csrf_of(c.get("/login").text)
    assert c.post("/login", data={"token": TOKEN, "csrf_token": tok}).status_code == 303
    assert c.get("/nodes").status_code == 200
    settings.controlplane.admin_token = "rotated"
    assert c.get("/nodes").status_code == 302


def test_logout(client):
    resp = client.post("/logout", data={"csrf_token": client.csrf})
    assert resp.status_code == 303
    assert client.get("/nodes").status_code == 302


def test_drain_form_requires_csrf(client, r):
    resp = client.post("/nodes/sim-a/drain", data={})
    assert resp.status_code == 400 and "CSRF" in resp.text
    resp = client.post("/nodes/sim-a/drain", data={"csrf_token": "forged"})
    assert resp.status_code == 400
    assert registry.get_state(r, "sim-a").state == "active"
    assert registry.recent_events(r, 5) == []


def test_two_page_sessions_are_told_apart_in_the_events(client, app, r):
    """Two browsers of one address log in with the one admin token: their changes carry
    the address and a tag of each login session, never the session id itself."""
    other = app.test_client()
    other_csrf = login(other)
    assert client.post("/nodes/sim-a/drain", data={"csrf_token": client.csrf}).status_code == 303
    assert other.post("/nodes/sim-a/undrain", data={"csrf_token": other_csrf}).status_code == 303
    undrain, drain = registry.recent_events(r, 2)
    assert (drain["kind"], undrain["kind"]) == ("drain", "undrain")
    pattern = r"admin@127\.0\.0\.1 \(page [0-9a-f]{6}\)"
    assert re.fullmatch(pattern, drain["actor"]) and re.fullmatch(pattern, undrain["actor"])
    assert drain["actor"] != undrain["actor"]


def test_drain_and_undrain_forms(client, r):
    resp = client.post("/nodes/sim-a/drain", data={"csrf_token": client.csrf})
    assert resp.status_code == 303
    assert registry.get_state(r, "sim-a").state == "draining"
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "drain" and re.fullmatch(r"admin@127\.0\.0\.1 \(page [0-9a-f]{6}\)", ev["actor"])
    page = client.get("/nodes")
    row = re.search(r'<tr id="node-sim-a".*?</tr>', page.text, re.S).group(0)
    assert "draining" in row and "Undrain" in row and "sim-a: drain started" in page.text
    resp = client.post("/nodes/sim-a/undrain",
                       data={"csrf_token": client.csrf, "back": "/nodes/sim-a"})
    assert resp.status_code == 303 and resp.location == "/nodes/sim-a"
    assert registry.get_state(r, "sim-a").state == "active"
    resp = client.post("/nodes/nope/drain", data={"csrf_token": client.csrf}, follow_redirects=True)
    assert "no node named" in resp.text


def test_nodes_page_shows_metrics_edges_and_sparklines(client, r):
    now = time.time()
    r.set(keynames.node_metrics("sim-a"), json.dumps({
        "ts": now, "healthy": True, "queue_depth": 4, "running": 7, "kv_cache_usage": 0.42,
        "e2e_avg_s": 1.8, "ttft_avg_s": 0.12, "score": 0.3}))
    r.set(keynames.node_metrics("sim-b"), json.dumps({"ts": now, "healthy": False}))
    for i in range(10):
        r.lpush(keynames.node_history("sim-a"), json.dumps({"ts": now - 10 + i, "queue_depth": i,
                                                        "e2e_avg_s": 1 + i / 10}))
    r.hset(keynames.EDGES, "e1", json.dumps({"ts": now, "nodes": {
        "sim-a": {"inflight": 3, "requests": 50, "failures": 5, "breaker": "closed"}}}))
    page = client.get("/nodes")
    assert page.status_code == 200
    row_a = re.search(r'<tr id="node-sim-a".*?</tr>', page.text, re.S).group(0)
    for text in ("active", "up", "0.30", "42 %", "120 ms", "1.80 s", "10 %", ">3<", "closed"):
        assert text in row_a, text
    assert row_a.count("<polyline") == 2
    row_b = re.search(r'<tr id="node-sim-b".*?</tr>', page.text, re.S).group(0)
    assert "down" in row_b and "polyline" not in row_b
    # offline: no script, style or image from another origin; live refresh + fallback
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', page.text)
    assert "/api/v1/nodes" in page.text and 'http-equiv="refresh"' in page.text
    csp = page.headers["Content-Security-Policy"]
    nonce = re.search(r"script-src 'nonce-([^']+)'", csp).group(1)
    assert f'<script nonce="{nonce}">' in page.text


def test_page_can_poll_api_with_session_but_not_change_things(client, r):
    resp = client.get("/api/v1/nodes?history=1")
    assert resp.status_code == 200
    assert [n["name"] for n in resp.get_json()["nodes"]] == ["sim-a", "sim-b"]
    resp = client.post("/api/v1/nodes/sim-a/drain")
    assert resp.status_code == 401
    assert registry.get_state(r, "sim-a").state == "active"


def test_add_edit_remove_node_forms(client, r):
    resp = client.post("/nodes", data={"csrf_token": client.csrf, "name": "gpu-1",
                                       "url": "http://10.0.0.9:8000", "kind": "sglang",
                                       "weight": "2", "max_concurrency": "32"},
                       follow_redirects=True)
    assert "Node gpu-1 added." in resp.text
    assert registry.get_node(r, "gpu-1").max_concurrency == 32
    resp = client.post("/nodes", data={"csrf_token": client.csrf, "name": "gpu-2",
                                       "url": "http://10.0.0.9:8000", "weight": "0"},
                       follow_redirects=True)
    assert "Not added: weight" in resp.text and registry.get_node(r, "gpu-2") is None
    resp = client.post("/nodes", data={"csrf_token": client.csrf, "name": "gpu-2",
                                       "url": "http://10.0.0.9:8001#x"}, follow_redirects=True)
    assert "Not added: url: node url is the server root, without a path, query or fragment" \
        in resp.text and registry.get_node(r, "gpu-2") is None
    resp = client.post("/nodes/gpu-1/edit", data={"csrf_token": client.csrf, "weight": "5"},
                       follow_redirects=True)
    assert "Node gpu-1 saved: weight 2.0 → 5.0." in resp.text and registry.get_node(r, "gpu-1").weight == 5.0
    resp = client.post("/nodes/gpu-1/edit", data={"csrf_token": client.csrf, "url": "gopher://x"},
                       follow_redirects=True)
    assert "Not saved: url" in resp.text
    resp = client.post("/nodes/gpu-1/remove", data={"csrf_token": client.csrf},
                       follow_redirects=True)
    assert "tick the box" in resp.text and registry.get_node(r, "gpu-1") is not None
    resp = client.post("/nodes/gpu-1/remove", data={"csrf_token": client.csrf, "sure": "yes"},
                       follow_redirects=True)
    assert "Node gpu-1 removed." in resp.text and registry.get_node(r, "gpu-1") is None


def test_node_detail_and_events_pages(client, r):
    now = time.time()
    for i in range(20):
        r.lpush(keynames.node_history("sim-a"), json.dumps({"ts": now - 20 + i, "queue_depth": i,
                                                        "kv_cache_usage": i / 40}))
    client.post("/nodes/sim-a/drain", data={"csrf_token": client.csrf})
    registry.add_event(r, "health", "sim-b", "system", {"healthy": False})
    page = client.get("/nodes/sim-a")
    assert page.status_code == 200
    assert 'id="node-state">draining' in page.text
    assert page.text.count('class="chart"') == 6 and "queue depth (now 19)" in page.text
    assert "drain" in page.text and "sim-b" not in page.text.split("Recent events")[1]
    assert client.get("/nodes/nope").status_code == 404
    page = client.get("/events")
    assert page.status_code == 200 and "health" in page.text and "drain" in page.text
    page = client.get("/events?node=sim-b&limit=x")
    assert page.status_code == 200 and "healthy=false" in page.text
    assert "from=" not in page.text


def test_cache_page_shows_namespaces_and_flags_an_entry(client, r):
    ns, key = "cd" * 32, "ab" * 32
    cache_store.store(r, key, tenant="acme", model="m", namespace=ns, body="hello", ttl=300)
    r.hset(keynames.cache_ns_stats(ns), mapping={"hits_semantic": 7, "verified": 2, "wrong": 1})
    # what the embedder writes when it indexes an entry of the namespace
    r.hset(keynames.cache_ns_stats(ns), mapping={
        "model": "bank-bot", "tenant": "acme", "route": "/v1/chat/completions",
        "embedding_model": "bge-m3@10.0.0.5:8080"})
    r.set(keynames.cache_ns_sample(ns), "How do I <b>reset</b> it?", ex=300)
    r.hset(keynames.CACHE_THRESHOLD_RAISE, ns, "0.01")
    page = client.get("/cache")
    assert page.status_code == 200 and 'id="cache-namespaces"' in page.text
    row = page.text[page.text.index(f'id="ns-{ns[:16]}"'):]
    row = row[:row.index("</tr>")]
    assert ">7<" in row and "50 %" in row and "+0.010" in row
    assert "bank-bot" in row and "acme" in row and "bge-m3@10.0.0.5:8080" in row
    assert "How do I &lt;b&gt;reset&lt;/b&gt; it?" in row  # escaped
    assert "≈ 3.5" in row  # 7 semantic hits x 1 wrong of 2 verified
    no_csrf = client.post("/cache/flag", data={"entry": key})
    assert no_csrf.status_code == 400 and r.exists(keynames.cache_entry(key))
    done = client.post("/cache/flag", data={"csrf_token": client.csrf, "entry": key},
                       follow_redirects=True)
    assert "flagged as wrong and dropped" in done.text
    assert not r.exists(keynames.cache_entry(key))
    assert r.hget(keynames.cache_ns_stats(ns), "flagged") == "1"
    assert registry.recent_events(r, 1)[0]["kind"] == "cache_flag"
    unknown = client.post("/cache/flag", data={"csrf_token": client.csrf, "entry": "0" * 64},
                          follow_redirects=True)
    assert "Nothing flagged" in unknown.text


def test_purge_forgets_the_namespaces_sample_question(r):
    """The sample's own key, and the hash field where earlier versions kept it."""
    ns, other = "ce" * 32, "cf" * 32
    cache_store.store(r, "ac" * 32, tenant="acme", model="m", namespace=ns, body="x", ttl=300)
    for n in (ns, other):
        r.hset(keynames.cache_ns_stats(n), mapping={"hits_semantic": 3, "sample": "old Q?"})
        r.set(keynames.cache_ns_sample(n), "Q?", ex=300)
    assert [s.sample for s in cache_store.namespace_stats(r)] == ["Q?", "Q?"]
    assert cache_store.purge(r, tenant="acme") == 1
    assert r.hgetall(keynames.cache_ns_stats(ns)) == {"hits_semantic": "3"}
    assert not r.exists(keynames.cache_ns_sample(ns))
    assert r.get(keynames.cache_ns_sample(other)) == "Q?"
    assert cache_store.purge(r, all=True) == 0
    assert not r.hexists(keynames.cache_ns_stats(other), "sample")
    assert not r.exists(keynames.cache_ns_sample(other))
    assert r.hgetall(keynames.cache_ns_stats(other)) == {"hits_semantic": "3"}  # kept


def test_cache_purge_needs_confirmation(client, r):
    for i in range(4):
        cache_store.store(r, f"{i:032x}", tenant="acme" if i < 3 else "other", model="m",
                          namespace="ns", body="hello", ttl=300)
    r.hset(keynames.CACHE_STATS, mapping={"lookups": 8, "hits_exact": 2, "hits_semantic": 2})
    page = client.get("/cache")
    assert page.status_code == 200
    assert "50 %" in page.text and "exact 25 %" in page.text and 'value="acme"' in page.text
    confirm = client.post("/cache/purge", data={"csrf_token": client.csrf, "tenant": "acme",
                                                "scope": "filter"})
    assert confirm.status_code == 303 and "/cache/purge?" in confirm.location
    confirm = client.get(confirm.location)
    assert confirm.status_code == 200 and "Confirm purge" in confirm.text and "up to 3" in confirm.text
    assert cache_store.stats(r).entries == 4  # nothing purged yet
    cancel = client.post("/cache/purge/confirm", data={"csrf_token": client.csrf, "tenant": "acme",
                                                       "confirm": "no"}, follow_redirects=True)
    assert "Purge cancelled" in cancel.text and cache_store.stats(r).entries == 4
    done = client.post("/cache/purge/confirm", data={"csrf_token": client.csrf, "tenant": "acme",
                                                     "confirm": "yes"}, follow_redirects=True)
    assert "Purged 3 cache entries." in done.text and cache_store.stats(r).entries == 1
    assert registry.recent_events(r, 1)[0]["kind"] == "cache_purge"
    empty = client.post("/cache/purge", data={"csrf_token": client.csrf, "scope": "filter"},
                        follow_redirects=True)
    assert "Nothing purged" in empty.text
    confirm = client.post("/cache/purge", data={"csrf_token": client.csrf, "scope": "all"},
                          follow_redirects=True)
    assert "every" in confirm.text
    client.post("/cache/purge/confirm", data={"csrf_token": client.csrf, "scope": "all",
                                              "confirm": "yes"})
    assert cache_store.stats(r).entries == 0
    resp = client.post("/cache/purge/confirm", data={"scope": "all", "confirm": "yes"})
    assert resp.status_code == 400


def test_cache_purge_form_with_a_value_the_cache_cannot_hold_says_so(client, r):
    """A scope value with a control character (a pasted tab, NUL) or over 256 characters
    got a 500 from the confirmation page and from the confirm form (the cache's own check
    raised past the page); it is refused with a message, and nothing is purged."""
    cache_store.store(r, f"{1:032x}", tenant="acme", model="m", namespace="ns",
                      body="hello", ttl=300)
    for bad in ("sim\tllama", "a\x00b", "m" * 257):
        page = client.get("/cache/purge", query_string={"model": bad})
        assert page.status_code == 303, (bad, page.status_code)
        shown = client.get(page.location)
        assert "Nothing purged: model: a non-empty printable text" in shown.text
        done = client.post("/cache/purge/confirm", data={"csrf_token": client.csrf,
                                                         "model": bad, "confirm": "yes"})
        assert done.status_code == 303, (bad, done.status_code)
        assert "Nothing purged" in client.get(done.location).text
    assert cache_store.stats(r).entries == 1
    resp = client.post("/api/v1/cache/purge", json={"tenant": "a\u0000b"},
                       headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 400
    assert resp.get_json()["error"]["message"].startswith("tenant: a non-empty printable text")


def test_cache_purge_from_the_page_deletes_the_vectors(client, r):
    pytest.importorskip("numpy")
    keys = [f"{i:032x}" for i in range(4)]
    for i, k in enumerate(keys):
        cache_store.store(r, k, tenant="acme" if i < 3 else "other", model="m",
                          namespace="ns", body="hello", ttl=300)
    vecs = write_vectors(r, keys)
    client.post("/cache/purge/confirm", data={"csrf_token": client.csrf, "tenant": "acme",
                                              "confirm": "yes"})
    assert cache_store.stats(r).entries == 1 and vector_keys(r) == {vecs[3]}
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "cache_purge" and re.fullmatch(r"admin@127\.0\.0\.1 \(page [0-9a-f]{6}\)", ev["actor"])
    assert ev["detail"] == {"tenant": "acme", "purged": 3}
    client.post("/cache/purge/confirm", data={"csrf_token": client.csrf, "scope": "all",
                                              "confirm": "yes"})
    assert cache_store.stats(r).entries == 0 and vector_keys(r) == set()


def test_keys_page_shows_a_new_key_once(client, r):
    resp = client.post("/keys", data={"csrf_token": client.csrf, "tenant": "acme",
                                      "rpm": "60", "tpm": ""})
    assert resp.status_code == 303 and resp.location == "/keys"
    resp = client.get(resp.location)
    assert resp.headers["Cache-Control"] == "no-store"
    key = re.search(r'id="new-key">(ig-[^<]+)<', resp.text).group(1)
    rec = apikeys.lookup(r, key)
    assert rec is not None and rec.rpm == 60 and rec.tpm is None
    page = client.get("/keys")
    assert key not in page.text and rec.id in page.text
    bad = client.post("/keys", data={"csrf_token": client.csrf, "tenant": "acme", "rpm": "-3"},
                      follow_redirects=True)
    assert "No key created: rpm" in bad.text
    client.post(f"/keys/{rec.id}/limits", data={"csrf_token": client.csrf, "rpm": "", "tpm": "500"})
    assert apikeys.lookup(r, key).tpm == 500 and apikeys.lookup(r, key).rpm is None
    resp = client.post(f"/keys/{rec.id}/revoke", data={"csrf_token": client.csrf},
                       follow_redirects=True)
    assert f"Key {rec.id} (acme) revoked." in resp.text
    assert apikeys.lookup(r, key) is None


def test_redis_down_page(redis_server):
    # the Redis client the control plane gives the admin app: one immediate retry, so a
    # dead Redis answers at once (redis-py's default retries back off for seconds)
    client = make_app(make_client(redis_server.url, 2.0)).test_client()
    login(client)
    redis_server.stop()
    resp = client.get("/nodes")
    assert resp.status_code == 503 and "Redis unavailable" in resp.text


def _node_form(page: str) -> dict:
    """The fields of the node page's edit form as the browser would send them."""
    form = re.search(r'<form method="post" action="/nodes/[^"]+/edit" id="edit-node">(.*?)</form>',
                     page, re.S).group(1)
    data = dict(re.findall(r'<input type="(?:hidden|text|number)" name="([^"]+)"[^>]*? value="([^"]*)"',
                           form))
    data.pop("csrf_token", None)
    assert {"url", "weight", "seen_weight", "max_concurrency"} <= set(data), data
    data["kind"] = re.search(r"<option selected>([^<]+)<", form).group(1)
    return data


def test_a_stale_node_form_never_reverts_a_change_made_meanwhile(app, client, r):
    """Sessions A and B open /nodes/sim-a; A saves weight 2.5; B (page loaded before)
    saves max concurrency 8: both changes are kept. B then changes the weight from the
    value its page showed: refused, nothing saved."""
    b = app.test_client()
    b.csrf = login(b)
    form_a = _node_form(client.get("/nodes/sim-a").text)
    form_b = _node_form(b.get("/nodes/sim-a").text)
    assert form_b["seen_weight"] == "1.0" and form_b["seen_max_concurrency"] == "64"
    resp = client.post("/nodes/sim-a/edit", data={**form_a, "weight": "2.5",
                                                   "csrf_token": client.csrf},
                       follow_redirects=True)
    assert "Node sim-a saved: weight 1.0 → 2.5." in resp.text
    resp = b.post("/nodes/sim-a/edit", data={**form_b, "max_concurrency": "8",
                                              "csrf_token": b.csrf}, follow_redirects=True)
    assert "Node sim-a saved: max_concurrency 64 → 8." in resp.text
    node = registry.get_node(r, "sim-a")
    assert (node.weight, node.max_concurrency) == (2.5, 8)
    # B's stale page changes the weight A changed: refused, nothing saved (not even kind)
    resp = b.post("/nodes/sim-a/edit", data={**form_b, "weight": "3", "kind": "tgi",
                                              "csrf_token": b.csrf}, follow_redirects=True)
    assert ("Not saved: weight was changed by someone else since you opened this page "
            "(now 2.5); reload the page") in resp.text
    node = registry.get_node(r, "sim-a")
    assert (node.weight, node.kind, node.max_concurrency) == (2.5, "vllm", 8)
    # B's stale page sets the weight to what A set: no conflict, nothing to change
    resp = b.post("/nodes/sim-a/edit", data={**form_b, "weight": "2.5", "csrf_token": b.csrf},
                  follow_redirects=True)
    assert "Node sim-a: nothing changed." in resp.text
    # reloaded, the same change goes through
    form_b = _node_form(b.get("/nodes/sim-a").text)
    b.post("/nodes/sim-a/edit", data={**form_b, "weight": "3", "csrf_token": b.csrf})
    assert registry.get_node(r, "sim-a").weight == 3.0


def test_empty_node_form_fields_reset_to_defaults_and_an_empty_url_is_refused(client, r):
    registry.put_node(r, NodeSettings(name="gpu-9", url="http://10.0.0.9:8000", kind="tgi",
                                      weight=2, max_concurrency=8, metrics_path="/m",
                                      health_path="/h"))
    page = client.get("/nodes/gpu-9").text
    assert "empty = default 64" in page and "empty = default /health" in page
    form = {**_node_form(page), "csrf_token": client.csrf}
    events = len(registry.recent_events(r, 100))
    resp = client.post("/nodes/gpu-9/edit", data=form, follow_redirects=True)
    assert "Node gpu-9: nothing changed." in resp.text
    assert len(registry.recent_events(r, 100)) == events, "no event for nothing"
    resp = client.post("/nodes/gpu-9/edit", data={**form, "url": " "}, follow_redirects=True)
    assert "Not saved: url: required" in resp.text
    assert registry.get_node(r, "gpu-9").url == "http://10.0.0.9:8000"
    resp = client.post("/nodes/gpu-9/edit",
                       data={**form, "weight": "", "max_concurrency": "", "metrics_path": "",
                             "health_path": "", "kind": ""}, follow_redirects=True)
    assert "Node gpu-9 saved: " in resp.text
    node = registry.get_node(r, "gpu-9")
    assert (node.kind, node.weight, node.max_concurrency, node.metrics_path,
            node.health_path) == ("vllm", 1.0, 64, "/metrics", "/health")
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "node_edit" and ev["detail"]["max_concurrency"] == [8, 64]
    assert len(registry.recent_events(r, 100)) == events + 1


def _key_form(page: str, key_id: str) -> dict:
    row = re.search(rf'<tr id="key-{key_id}">(.*?)</tr>', page, re.S).group(1)
    form = re.search(r'action="/keys/[^"]+/limits">(.*?)</form>', row, re.S).group(1)
    data = dict(re.findall(r'<input type="(?:hidden|number)" name="([^"]+)"[^>]*? value="([^"]*)"',
                           form))
    data.pop("csrf_token", None)
    return data


def test_a_stale_keys_form_never_reverts_a_limit_set_meanwhile(app, client, r):
    _, rec = apikeys.create_key(r, "acme")
    b = app.test_client()
    b.csrf = login(b)
    form_a = _key_form(client.get("/keys").text, rec.id)
    form_b = _key_form(b.get("/keys").text, rec.id)
    assert form_b == {"seen_rpm": "", "seen_tpm": "", "rpm": "", "tpm": ""}
    resp = client.post(f"/keys/{rec.id}/limits", data={**form_a, "rpm": "100",
                                                       "csrf_token": client.csrf},
                       follow_redirects=True)
    assert f"Key {rec.id}: limits saved." in resp.text
    # B's page still shows rpm empty: its tpm change keeps A's rpm
    resp = b.post(f"/keys/{rec.id}/limits", data={**form_b, "tpm": "500", "csrf_token": b.csrf},
                  follow_redirects=True)
    assert f"Key {rec.id}: limits saved." in resp.text
    got = apikeys.get_key(r, rec.id)
    assert (got.rpm, got.tpm) == (100, 500)
    # B (the same stale page) changes the rpm A changed: refused, nothing saved
    resp = b.post(f"/keys/{rec.id}/limits", data={**form_b, "rpm": "7",
                                                  "csrf_token": b.csrf}, follow_redirects=True)
    assert ("Limits not changed: rpm was changed by someone else since you opened this page "
            "(now 100); reload the page") in resp.text
    got = apikeys.get_key(r, rec.id)
    assert (got.rpm, got.tpm) == (100, 500)
    resp = b.post(f"/keys/{rec.id}/limits", data={**form_b, "rpm": "100", "csrf_token": b.csrf},
                  follow_redirects=True)
    assert f"Key {rec.id}: nothing changed." in resp.text     # the value A set: no conflict
    events = len(registry.recent_events(r, 100))
    form_a = _key_form(client.get("/keys").text, rec.id)
    resp = client.post(f"/keys/{rec.id}/limits", data={**form_a, "csrf_token": client.csrf},
                       follow_redirects=True)
    assert f"Key {rec.id}: nothing changed." in resp.text
    assert len(registry.recent_events(r, 100)) == events


def test_draining_the_last_active_node_from_the_page_warns(client, r):
    client.post("/nodes/sim-a/drain", data={"csrf_token": client.csrf})
    resp = client.post("/nodes/sim-b/drain", data={"csrf_token": client.csrf},
                       follow_redirects=True)
    assert "sim-b: drain started, now draining." in resp.text
    assert ('<div class="flash error" role="status">Warning: no active node is left: every '
            'request will get 503 no_healthy_upstream') in resp.text
    assert registry.get_state(r, "sim-b").state == "draining"
