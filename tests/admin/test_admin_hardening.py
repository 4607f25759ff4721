"""Admin hardening: login and Bearer attempts throttled per client address (429 +
Retry-After), logout revokes the session server-side, the session cookie is Secure over
TLS, node URLs to link-local / metadata addresses and to the stack's own ports are
refused (API, page, CLI) unless allowed, a ``next`` with CR/LF is a 400, and breaker
openings/closings reported by the edges become ``breaker`` events (real redis-server,
Flask test client, click's CliRunner)."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
import redis
from click.testing import CliRunner

from controlplane import procs
from controlplane.admin import COOKIE_PREFIX, auth, create_app, ops, session_cookie_name
from controlplane.cli import main
from controlplane.config import Settings
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane, breaker_changes
from controlplane.routing.wire import EdgeReport

TOKEN = "hardening-admin-token-789"


def make_app(r, **cp: object):
    s = Settings.model_validate({"controlplane": {"admin_token": TOKEN, **cp}})
    return create_app(s, r, secret_key="fixed-test-secret")


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF field in the page"
    return m.group(1)


def login(c, **kw: object):
    page = c.get("/login", **kw)
    assert page.status_code == 200
    return c.post("/login", data={"token": TOKEN, "csrf_token": csrf_of(page.text)}, **kw)


def session_cookie(resp) -> str:
    return next(h for h in resp.headers.getlist("Set-Cookie") if h.startswith(COOKIE_PREFIX))


def test_session_cookie_name_is_one_per_deployment() -> None:
    """Cookies are scoped by host, not port: two stacks on one host (their own Redis
    each) need two cookie names, or a login to one logs the user out of the other;
    control planes sharing a Redis share the name, whatever password they spell."""
    def name(url: str) -> str:
        return session_cookie_name(Settings.model_validate({"redis": {"url": url}}))

    a = name("redis://:pw1@127.0.0.1:6379/0")
    assert a.startswith(COOKIE_PREFIX) and len(a) == len(COOKIE_PREFIX) + 8
    assert a == name("redis://:other@127.0.0.1:6379/0") == name("redis://127.0.0.1:6379/0")
    assert len({a, name("redis://127.0.0.1:6380/0"), name("redis://127.0.0.1:6379/1")}) == 3


def test_two_deployments_on_one_host_keep_their_own_logins(r) -> None:
    one = make_app(r)
    other = create_app(Settings.model_validate({
        "controlplane": {"admin_token": TOKEN}, "redis": {"url": "redis://127.0.0.1:1/0"}}),
        r, secret_key="another-secret")
    c = one.test_client()
    assert login(c).status_code == 303
    # the other stack's login lands in the same cookie jar (same host, other port)
    c2 = other.test_client()
    resp = login(c2)
    set_cookie = next(h for h in resp.headers.getlist("Set-Cookie") if h.startswith(COOKIE_PREFIX))
    name, value = set_cookie.split(";", 1)[0].split("=", 1)
    c.set_cookie(name, value)
    assert c.get("/nodes").status_code == 200  # still logged in to the first


# ---- throttling -----------------------------------------------------------------------


def test_wrong_bearer_tokens_are_throttled_per_address(r):
    app = make_app(r)
    c = app.test_client()
    bad = {"Authorization": "Bearer wrong"}
    codes = [c.get("/api/v1/nodes", headers=bad).status_code for _ in range(auth.THROTTLE_BURST)]
    assert codes == [401] * auth.THROTTLE_BURST
    resp = c.get("/api/v1/nodes", headers=bad)
    assert resp.status_code == 429
    assert resp.get_json()["error"]["code"] == "admin_auth_throttled"
    assert resp.get_json()["error"]["type"] == "rate_limit_error"
    assert int(resp.headers["Retry-After"]) >= 1
    # while throttled the right token is still accepted (only failures are refused)
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert c.get("/api/v1/nodes", headers=good).status_code == 200
    assert c.get("/api/v1/nodes", headers=bad).status_code == 429
    # another address is not affected
    other = c.get("/api/v1/nodes", headers=bad, environ_base={"REMOTE_ADDR": "10.9.9.9"})
    assert other.status_code == 401
    # the budget refills (THROTTLE_RATE_PER_S per second)
    time.sleep(1.0 / auth.THROTTLE_RATE_PER_S + 0.1)
    assert c.get("/api/v1/nodes", headers=bad).status_code == 401
    # correct tokens spend nothing
    for _ in range(3 * auth.THROTTLE_BURST):
        assert c.get("/api/v1/nodes", headers=good).status_code == 200


def test_failed_logins_are_throttled(r):
    app = make_app(r)
    c = app.test_client()
    tok = csrf_of(c.get("/login").text)
    for _ in range(auth.THROTTLE_BURST):
        resp = c.post("/login", data={"token": "nope", "csrf_token": tok})
        assert resp.status_code == 303
    resp = c.post("/login", data={"token": "nope", "csrf_token": tok})
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
    assert "Too many" in resp.text
    assert c.get("/nodes").status_code == 302                      # not logged in
    # the correct token still logs in while the address is throttled
    resp = c.post("/login", data={"token": TOKEN, "csrf_token": tok})
    assert resp.status_code == 303
    assert c.get("/nodes").status_code == 200


def test_correct_token_accepted_during_a_guessing_flood_from_its_address(r):
    """Someone guessing tokens from the admin's own address (a shared NAT) never locks
    the admin out: 10 of 10 correct attempts succeed on the API and the login form, while
    the guesses stay refused (401, then 429)."""
    app = make_app(r)
    guesser, admin = app.test_client(), app.test_client()
    bad = {"Authorization": "Bearer guess"}
    good = {"Authorization": f"Bearer {TOKEN}"}
    api_ok = login_ok = 0
    guesses: list[int] = []
    for i in range(10):
        guesses += [guesser.get("/api/v1/nodes", headers=bad).status_code for _ in range(20)]
        api_ok += admin.get("/api/v1/nodes", headers=good).status_code == 200
        form = app.test_client()
        tok = csrf_of(form.get("/login").text)
        guesses.append(form.post("/login", data={"token": f"guess{i}", "csrf_token": tok}).status_code)
        resp = form.post("/login", data={"token": TOKEN, "csrf_token": tok})
        login_ok += resp.status_code == 303 and form.get("/nodes").status_code == 200
    assert (api_ok, login_ok) == (10, 10)
    assert set(guesses) <= {401, 303, 429} and guesses.count(429) > len(guesses) // 2


def test_forwarded_for_counts_only_behind_a_trusted_proxy(r):
    bad = {"Authorization": "Bearer wrong"}

    def burn(app, xff: str) -> int:
        c = app.test_client()
        for _ in range(auth.THROTTLE_BURST):
            c.get("/api/v1/nodes", headers={**bad, "X-Forwarded-For": xff})
        return c.get("/api/v1/nodes", headers={**bad, "X-Forwarded-For": "198.51.100.7"}).status_code

    # untrusted: the header is ignored, every request is the peer's
    assert burn(make_app(r), "203.0.113.5") == 429
    # trusted proxy: each forwarded client has its own budget
    assert burn(make_app(r, trusted_proxies=["127.0.0.0/8"]), "203.0.113.5") == 401


# ---- sessions -------------------------------------------------------------------------


def test_logout_revokes_the_session_server_side(r):
    app = make_app(r)
    c = app.test_client()
    resp = login(c)
    assert resp.status_code == 303
    cookie = session_cookie(resp).split(";", 1)[0].split("=", 1)[1]
    assert c.get("/nodes").status_code == 200
    assert len(r.keys(keynames.ADMIN_SESSION_PREFIX + "*")) == 1
    page = c.get("/nodes").text
    assert c.post("/logout", data={"csrf_token": csrf_of(page)}).status_code == 303
    assert r.keys(keynames.ADMIN_SESSION_PREFIX + "*") == []
    # the old cookie, replayed by another client, no longer works
    thief = app.test_client()
    thief.set_cookie(app.config["SESSION_COOKIE_NAME"], cookie)
    assert thief.get("/nodes").status_code == 302
    assert thief.get("/api/v1/nodes").status_code == 401


def test_logout_while_redis_is_down_stays_a_logout(workdir):
    """Logged out while Redis does not answer, the session id cannot be deleted there; a
    Redis restarted from its append-only file brings the id back, and the logout's
    background retry deletes it there; the replayed cookie stays refused."""
    port = procs.free_port()
    m = procs.start_redis(workdir / "redis", port, persistent=True)
    try:
        r = redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2)
        app = make_app(r)
        c = app.test_client()
        resp = login(c)
        cookie = session_cookie(resp).split(";", 1)[0].split("=", 1)[1]
        page = c.get("/nodes").text
        (key,) = r.keys(keynames.ADMIN_SESSION_PREFIX + "*")
        m.stop()
        assert c.post("/logout", data={"csrf_token": csrf_of(page)}).status_code == 303
        m = procs.start_redis(workdir / "redis", port, persistent=True)
        # reloaded from the append-only file, then deleted by the background retry,
        # without any admin request (another control plane on this Redis refuses it too)
        procs.wait_until(lambda: not r.exists(key), 10, what="the ended session deleted")
        thief = app.test_client()
        thief.set_cookie(app.config["SESSION_COOKIE_NAME"], cookie)
        assert thief.get("/nodes").status_code == 302
        assert thief.get("/api/v1/nodes").status_code == 401
        assert c.get("/login").status_code == 200 and login(c).status_code == 303
        assert c.get("/nodes").status_code == 200  # a new login works as before
    finally:
        m.stop()


def test_session_ttl_and_expiry_in_redis(r):
    app = make_app(r)
    c = app.test_client()
    login(c)
    (key,) = r.keys(keynames.ADMIN_SESSION_PREFIX + "*")
    assert 0 < r.ttl(key) <= auth.SESSION_TTL_S
    r.delete(key)                                   # expired (or revoked elsewhere)
    assert c.get("/nodes").status_code == 302


def test_session_cookie_secure_over_tls_or_when_configured(r):
    plain = session_cookie(login(make_app(r).test_client()))
    assert "Secure" not in plain and "HttpOnly" in plain and "SameSite=Strict" in plain
    tls = session_cookie(login(make_app(r).test_client(), base_url="https://admin.example"))
    assert "Secure" in tls
    # X-Forwarded-Proto counts from a trusted proxy only
    fwd = {"headers": {"X-Forwarded-Proto": "https"}}
    assert "Secure" not in session_cookie(login(make_app(r).test_client(), **fwd))
    trusted = make_app(r, trusted_proxies=["127.0.0.1/32"])
    assert "Secure" in session_cookie(login(trusted.test_client(), **fwd))
    forced = make_app(r, cookie_secure=True)
    assert "Secure" in session_cookie(login(forced.test_client()))


def test_next_with_cr_lf_is_a_400(r):
    app = make_app(r)
    c = app.test_client()
    assert c.get("/login?next=/nodes%0d%0aSet-Cookie:%20x=1").status_code == 400
    tok = csrf_of(c.get("/login").text)
    resp = c.post("/login", data={"token": TOKEN, "csrf_token": tok, "next": "/a\r\nX: y"})
    assert resp.status_code == 400
    login(c)
    assert c.get("/login?next=/x%0aY").status_code == 400


# ---- node URLs ------------------------------------------------------------------------

REFUSED = ["http://169.254.169.254", "http://169.254.10.1:8000", "http://[fe80::1]:8000",
           "http://[fd00:ec2::254]", "http://metadata.google.internal",
           "http://[::ffff:169.254.169.254]:80"]


@pytest.mark.parametrize("url", REFUSED)
def test_api_refuses_metadata_and_link_local_node_urls(r, url):
    c = make_app(r).test_client()
    h = {"Authorization": f"Bearer {TOKEN}"}
    resp = c.post("/api/v1/nodes", headers=h, json={"name": "meta", "url": url})
    assert resp.status_code == 400, resp.text
    assert resp.get_json()["error"]["code"] == "node_url_refused"
    assert registry.get_node(r, "meta") is None


def test_api_refuses_own_ports_and_edits_too(r):
    app = make_app(r, listen="127.0.0.1:18081")
    settings = app.extensions["infergate"]["settings"]
    settings.redis.url = "redis://127.0.0.1:16379/0"
    c = app.test_client()
    h = {"Authorization": f"Bearer {TOKEN}"}
    settings.edge.listen = "127.0.0.1:18080"
    # Redis, admin, and the edge itself (a node there loops requests back into the edge)
    for url in ("http://127.0.0.1:16379", "http://localhost:18081", "http://127.0.0.1:18080"):
        resp = c.post("/api/v1/nodes", headers=h, json={"name": "own", "url": url})
        assert resp.status_code == 400 and "own" in resp.get_json()["error"]["message"], url
    for url in ("http://127.0.0.1:9002\n", "http://127.0.0.1:9002/\n", "http://127.0.0.1 :9002"):
        resp = c.post("/api/v1/nodes", headers=h, json={"name": "nl", "url": url})
        assert resp.status_code == 400 and "line breaks" in resp.get_json()["error"]["message"], url
    # a body that is not UTF-8 is refused, not stored with replacement characters
    resp = c.post("/api/v1/keys", headers={**h, "Content-Type": "application/json"},
                  data=b'{"tenant": "t", "label": "web\xed\xa0\x80"}')
    assert resp.status_code == 400 and "not UTF-8" in resp.get_json()["error"]["message"]
    resp = c.post("/api/v1/nodes", headers=h, json={"name": "idn", "url": "http://\u2460\u2461\u2466.0.0.1"})
    assert resp.status_code == 400
    assert "in ASCII, as 127.0.0.1" in resp.get_json()["error"]["message"]
    assert c.post("/api/v1/nodes", headers=h,
                  json={"name": "ok", "url": "http://127.0.0.1:9001"}).status_code == 201
    resp = c.patch("/api/v1/nodes/ok", headers=h, json={"url": "http://169.254.169.254"})
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "node_url_refused"
    assert registry.get_node(r, "ok").url == "http://127.0.0.1:9001"


def test_the_running_stacks_published_addresses_are_refused_whatever_the_config(r):
    """A control plane publishes the stack's addresses (controlplane.routing.ownaddrs):
    the CLI without the stack's file (only the Redis URL) and the admin API of a control
    plane with another file refuse them as nodes, for an add and an edit; a publication
    of a control plane gone quiet no longer counts."""
    from controlplane.routing import ownaddrs

    ownaddrs.publish(r, "cp-elsewhere", [ownaddrs.OwnAddress("edge API", "127.0.0.1", 18480),
                                         ownaddrs.OwnAddress("admin", "0.0.0.0", 18481)])
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0"
    runner = CliRunner()
    for name, target, what in (("loop", "http://127.0.0.1:18480", "own edge API port"),
                               ("loop2", "http://localhost:18481/", "own admin port")):
        res = runner.invoke(main, ["nodes", "--redis-url", url, "add", name, target])
        assert res.exit_code == 1 and what in res.output, res.output
        assert registry.get_node(r, name) is None
    # the defaults' ports are not that stack's: a node there is taken (llama-server's 8080)
    res = runner.invoke(main, ["nodes", "--redis-url", url, "add", "llama", "http://127.0.0.1:8080"])
    assert res.exit_code == 0, res.output
    assert registry.get_node(r, "llama") is not None
    registry.remove_node(r, "llama")
    c = make_app(r).test_client()
    h = {"Authorization": f"Bearer {TOKEN}"}
    resp = c.post("/api/v1/nodes", headers=h, json={"name": "loop", "url": "http://127.0.0.1:18480"})
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "node_url_refused"
    assert c.post("/api/v1/nodes", headers=h,
                  json={"name": "ok", "url": "http://127.0.0.1:18482"}).status_code == 201
    resp = c.patch("/api/v1/nodes/ok", headers=h, json={"url": "http://127.0.0.1:18481"})
    assert resp.status_code == 400 and "own admin port" in resp.get_json()["error"]["message"]
    assert registry.get_node(r, "ok").url == "http://127.0.0.1:18482"
    # another host's server on the same port is a node; a stale publication counts no more
    assert ops.node_url_refusal("http://10.0.0.5:18480", Settings(), ownaddrs.published(r)) is None
    ownaddrs.publish(r, "cp-elsewhere", [ownaddrs.OwnAddress("edge API", "127.0.0.1", 18480)],
                     now=time.time() - ownaddrs.FRESH_S - 1)
    assert ownaddrs.published(r) == []
    assert c.post("/api/v1/nodes", headers=h,
                  json={"name": "loop", "url": "http://127.0.0.1:18480"}).status_code == 201


def test_the_control_plane_publishes_its_addresses_and_takes_them_back(redis_server):
    from controlplane.routing import ownaddrs

    s = Settings.model_validate({"redis": {"url": redis_server.url},
                                 "controlplane": {"listen": "127.0.0.1:18591"},
                                 "edge": {"listen": "127.0.0.1:18590", "metrics_listen": ""}})
    r = redis_server.client()
    cp = ControlPlane(s, r)
    try:
        cp.run_cycle()
        got = {(a.what, a.host, a.port) for a in ownaddrs.published(r)}
        assert {("edge API", "127.0.0.1", 18590), ("admin", "127.0.0.1", 18591)} <= got
        assert r.ttl(keynames.STACK_ADDRESSES) > 0
    finally:
        cp.shutdown()
    assert ownaddrs.published(r) == []


def test_node_url_allow_list(r):
    app = make_app(r, node_url_allow=["169.254.10.0/24", "metadata.google.internal:8080"])
    c = app.test_client()
    h = {"Authorization": f"Bearer {TOKEN}"}
    assert c.post("/api/v1/nodes", headers=h,
                  json={"name": "a", "url": "http://169.254.10.5:8000"}).status_code == 201
    assert c.post("/api/v1/nodes", headers=h,
                  json={"name": "b", "url": "http://metadata.google.internal:8080"}).status_code == 201
    assert c.post("/api/v1/nodes", headers=h,
                  json={"name": "c", "url": "http://metadata.google.internal"}).status_code == 400
    assert c.post("/api/v1/nodes", headers=h,
                  json={"name": "d", "url": "http://169.254.169.254"}).status_code == 400


def test_page_refuses_a_metadata_node_url(r):
    c = make_app(r).test_client()
    login(c)
    tok = csrf_of(c.get("/nodes").text)
    resp = c.post("/nodes", data={"csrf_token": tok, "name": "meta",
                                  "url": "http://169.254.169.254"})
    assert resp.status_code == 303
    assert "link-local or cloud-metadata" in c.get(resp.location).text
    assert registry.get_node(r, "meta") is None


def test_cli_refuses_metadata_and_own_redis_port(redis_server):
    runner = CliRunner()
    res = runner.invoke(main, ["nodes", "--redis-url", redis_server.url, "add", "meta",
                               "http://169.254.169.254"])
    assert res.exit_code == 1 and "cloud-metadata" in res.output
    port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
    res = runner.invoke(main, ["nodes", "--redis-url", redis_server.url, "add", "loop",
                               f"http://127.0.0.1:{port}"])
    assert res.exit_code == 1 and "own Redis port" in res.output
    assert registry.get_node(redis_server.client(), "meta") is None


def test_node_url_refusal_unit():
    s = Settings()
    assert ops.node_url_refusal("http://10.0.0.5:8000", s) is None
    assert ops.node_url_refusal("http://169.254.169.254", None)
    assert ops.node_url_refusal("http://METADATA.google.internal.", s)
    assert ops.node_url_refusal("http://127.0.0.1:6379", s)            # default redis.url
    assert ops.node_url_refusal("http://127.0.0.1:8081", s)            # default admin
    assert ops.node_url_refusal("http://10.0.0.5:6379", s) is None     # another host's Redis


METADATA_SPELLINGS = ["http://2852039166", "http://0xa9fea9fe", "http://0251.0376.0251.0376",
                      "http://0xa9.0xfe.0xa9.0xfe:8000", "http://169.254.43518"]


@pytest.mark.parametrize("url", METADATA_SPELLINGS)
def test_numeric_spellings_of_the_metadata_address_are_refused(r, url):
    c = make_app(r).test_client()
    h = {"Authorization": f"Bearer {TOKEN}"}
    resp = c.post("/api/v1/nodes", headers=h, json={"name": "meta", "url": url})
    assert resp.status_code == 400, resp.text
    assert resp.get_json()["error"]["code"] == "node_url_refused"
    assert registry.get_node(r, "meta") is None


def test_numeric_spellings_of_loopback_reach_no_own_port():
    s = Settings.model_validate({"controlplane": {"listen": "127.0.0.1:18081"}})
    for url in ("http://127.1:18081", "http://017700000001:18081", "http://0x7f000001:18081",
                "http://2130706433:18081", "http://[::ffff:7f00:1]:18081"):
        assert "own admin port" in (ops.node_url_refusal(url, s) or ""), url
    assert ops.node_url_refusal("http://127.1:18082", s) is None
    # an IPv6 address is shown as it is written in a URL, in brackets
    assert (ops.node_url_refusal("http://[::1]:18081", s) or "").startswith(
        "url: [::1]:18081 is this stack's own admin port")


def test_embedder_and_edge_metrics_ports_are_refused():
    s = Settings.model_validate({"cache": {"embedder_url": "http://127.0.0.1:18090"},
                                 "edge": {"metrics_listen": "127.0.0.1:19145"}})
    assert "own embedder port" in ops.node_url_refusal("http://localhost:18090", s)
    assert "own edge metrics port" in ops.node_url_refusal("http://127.0.0.1:19145", s)
    assert ops.node_url_refusal("http://10.0.0.5:18090", s) is None
    allowed = s.model_copy(deep=True)
    allowed.controlplane.node_url_allow = ["127.0.0.1:18090"]
    assert ops.node_url_refusal("http://127.0.0.1:18090", allowed) is None


def test_host_names_are_resolved(monkeypatch, r):
    table = {"169.254.169.254.nip.io": ["169.254.169.254"],
             "twofaced.example": ["10.0.0.7", "169.254.169.254"],
             "gpu-1.example": ["10.0.0.8"],
             "loop.example": ["127.0.0.1"]}

    def fake_getaddrinfo(host, port, *a, **kw):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in table[host]]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    s = Settings.model_validate({"controlplane": {"listen": "127.0.0.1:18081"}})
    assert "cloud-metadata" in ops.node_url_refusal("http://169.254.169.254.nip.io", s)
    assert "169.254.169.254" in ops.node_url_refusal("http://twofaced.example:8000", s)
    assert ops.node_url_refusal("http://gpu-1.example:8000", s) is None
    assert "own admin port" in ops.node_url_refusal("http://loop.example:18081", s)
    assert "does not resolve" in ops.node_url_refusal("http://nowhere.invalid:8000", s)
    allowed = s.model_copy(deep=True)
    allowed.controlplane.node_url_allow = ["nowhere.invalid"]
    assert ops.node_url_refusal("http://nowhere.invalid:8000", allowed) is None
    c = make_app(r).test_client()
    h = {"Authorization": f"Bearer {TOKEN}"}
    resp = c.post("/api/v1/nodes", headers=h,
                  json={"name": "nip", "url": "http://169.254.169.254.nip.io"})
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "node_url_refused"


def test_a_hung_resolver_costs_the_timeout_only(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **kw: time.sleep(30))
    t0 = time.monotonic()
    assert ops.resolve_host("slow.example", 80, timeout=0.3) is None
    assert time.monotonic() - t0 < 2


# ---- breaker events -------------------------------------------------------------------


def _report(edge: str, breaker: str, ts: float) -> str:
    return json.dumps({"edge_id": edge, "ts": ts,
                       "nodes": {"sim-a": {"breaker": breaker, "requests": 1}}})


def test_breaker_changes_unit():
    rep = lambda b: [EdgeReport.from_dict(json.loads(_report("e1", b, 1.0)))]  # noqa: E731
    seen, ev = breaker_changes({}, rep("closed"))
    assert ev == []
    seen, ev = breaker_changes(seen, rep("open"))
    assert ev == [("sim-a", {"state": "open", "edge": "e1"})]
    seen, ev = breaker_changes(seen, rep("open"))
    assert ev == []
    seen, ev = breaker_changes(seen, rep("half_open"))
    assert ev == []
    seen, ev = breaker_changes(seen, rep("closed"))
    assert ev == [("sim-a", {"state": "closed", "edge": "e1"})]
    assert breaker_changes({}, rep("open"))[1][0][1]["state"] == "open"   # first seen open


def test_breaker_openings_and_closings_become_events(r):
    # nothing listens on the discard port: polls fail fast, the cycle goes on
    s = Settings.model_validate({"controlplane": {"admin_token": TOKEN},
                                 "nodes": [{"name": "sim-a", "url": "http://127.0.0.1:9",
                                            "kind": "openai"}]})
    cp = ControlPlane(s, r, ident="cp-test")
    try:
        assert cp.run_cycle().leader
        r.hset(keynames.EDGES, "edge-1", _report("edge-1", "open", time.time()))
        cp.run_cycle()
        r.hset(keynames.EDGES, "edge-1", _report("edge-1", "half_open", time.time()))
        cp.run_cycle()
        r.hset(keynames.EDGES, "edge-1", _report("edge-1", "closed", time.time()))
        cp.run_cycle()
    finally:
        cp.shutdown()
    got = [(e["kind"], e["node"], e["detail"]) for e in registry.recent_events(r, 50)
           if e["kind"] == "breaker"]
    assert got == [("breaker", "sim-a", {"state": "closed", "edge": "edge-1"}),
                   ("breaker", "sim-a", {"state": "open", "edge": "edge-1"})]


#: Cloud metadata addresses other than link-local, and IPv6 spellings that embed the
#: IPv4 metadata addresses (a NAT64 gateway, a 6to4 relay or a Teredo tunnel on the path
#: would deliver them there).
METADATA_V6_AND_CLOUD = [
    "http://100.100.100.200",                      # Alibaba Cloud metadata
    "http://192.0.0.192",                          # Oracle Cloud Classic metadata
    "http://168.63.129.16",                        # Azure wire server
    "http://[64:ff9b::a9fe:a9fe]",                 # NAT64 well-known prefix
    "http://[64:ff9b::169.254.169.254]:8000",
    "http://[64:ff9b::6464:64c8]",                 # NAT64 of 100.100.100.200
    "http://[64:ff9b:1::a9fe:a9fe]",               # NAT64 local-use prefix
    "http://[::ffff:a9fe:a9fe]",                   # IPv4-mapped
    "http://[::ffff:0:a9fe:a9fe]",                 # IPv4-translated (SIIT)
    "http://[::a9fe:a9fe]",                        # IPv4-compatible
    "http://[::169.254.169.254]",
    "http://[2002:a9fe:a9fe::]",                   # 6to4
    "http://[2002:a9fe:a9fe:1::5]:8000",
    "http://[2001:0:a9fe:a9fe::1]",                # Teredo, metadata as the server
    "http://[2001:0:4136:e378:8000:63bf:5601:5601]",  # Teredo, metadata as the client
]


@pytest.mark.parametrize("url", METADATA_V6_AND_CLOUD)
def test_ipv6_embeddings_and_other_cloud_metadata_addresses_are_refused(url):
    why = ops.node_url_refusal(url, Settings())
    assert why and "cloud-metadata" in why, url


def test_ordinary_ipv6_and_cgnat_addresses_stay_allowed():
    s = Settings()
    for url in ("http://[2001:db8::5]:8000", "http://[64:ff9b::a00:5]:8000",
                "http://[2002:a00:5::1]:8000", "http://100.100.100.201:8000",
                "http://[2001:0:4136:e378:8000:63bf:f5ff:fffa]:8000"):
        assert ops.node_url_refusal(url, s) is None, url


def test_api_refuses_the_nat64_metadata_spelling(r):
    c = make_app(r).test_client()
    h = {"Authorization": f"Bearer {TOKEN}"}
    resp = c.post("/api/v1/nodes", headers=h, json={"name": "meta", "url": "http://[64:ff9b::a9fe:a9fe]"})
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "node_url_refused"
    assert registry.get_node(r, "meta") is None


def test_keys_page_says_when_edges_keep_keys_of_a_missing_store(r):
    c = make_app(r).test_client()
    assert login(c).status_code == 303
    assert 'id="keys-store-missing"' not in c.get("/keys").text
    r.hset(keynames.EDGES, "edge-a", json.dumps({"ts": time.time(),
                                                  "admission": {"auth_store_missing": 1}}))
    page = c.get("/keys").text
    assert 'id="keys-store-missing"' in page and "edge-a" in page
    assert "infergate keys import" in page
    # a stale report (an edge gone for long) does not count
    r.hset(keynames.EDGES, "edge-a", json.dumps({"ts": time.time() - 3600,
                                                  "admission": {"auth_store_missing": 1}}))
    assert 'id="keys-store-missing"' not in c.get("/keys").text


def test_idle_connections_do_not_lock_the_admin_api_out(redis_server, controlplane_factory) -> None:
    """150 connections that send nothing (more than waitress's default of 100) leave the
    admin API answering: `up`'s health check of the control plane, and the operator, get
    through (before, ~100 idle connections locked everyone out and `up` killed the
    control plane as frozen)."""
    from controlplane.config import settings_from_dict

    cp = controlplane_factory(settings_from_dict({"redis": {"url": redis_server.url}}),
                              wait_snapshot=False)
    host, port = cp.admin_url.removeprefix("http://").rstrip("/").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(150)]
    try:
        import requests

        res = requests.get(cp.admin_url.rstrip("/") + "/healthz", timeout=5)
        assert res.status_code == 200
    finally:
        for s in idle:
            s.close()
