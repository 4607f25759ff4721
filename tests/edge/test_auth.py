"""API keys at the edge (lua/infergate/admission/auth.lua) with a real nginx, Redis and upstream:
missing, wrong and revoked keys, the revocation delay of the edge's key cache, the
key kept out of logs and away from the nodes, Redis down (cached keys work, unknown
keys get 503, nothing gets 500), auth off."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.config import NodeSettings, Settings
from controlplane.edge.render import render_nginx, start_nginx
from support.stack import Edge, edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


class HeaderUpstream:
    """OpenAI-compatible upstream that records the headers of every request it gets."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.port = procs.free_port()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                upstream.headers.append({k.lower(): v for k, v in self.headers.items()})
                self._answer({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                upstream.headers.append({k.lower(): v for k, v in self.headers.items()})
                self._answer({"id": "x", "object": "chat.completion", "model": "tiny",
                              "choices": [{"index": 0, "finish_reason": "stop",
                                           "message": {"role": "assistant", "content": "ok"}}],
                              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        class Server(ThreadingHTTPServer):
            request_queue_size = 128   # listen backlog (5 by default): bursts of requests

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def node(self) -> NodeSettings:
        return NodeSettings(name="hdr", url=f"http://127.0.0.1:{self.port}")

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[HeaderUpstream]:
    u = HeaderUpstream()
    try:
        yield u
    finally:
        u.stop()


def auth_settings(redis_url: str, node: NodeSettings, **auth: Any) -> Settings:
    s = edge_settings(redis_url, [node])
    s.auth.mode = "required"
    for k, v in auth.items():
        setattr(s.auth, k, v)
    s.limits.redis_retry_s = 0.2
    return s


def post(edge: Any, key: str | None, body: dict = CHAT) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(f"{edge.url}/v1/chat/completions", json=body, headers=headers, timeout=10)


def assert_invalid_key(res: requests.Response) -> None:
    assert res.status_code == 401, res.text
    assert res.headers["Content-Type"] == "application/json"
    assert res.headers["WWW-Authenticate"].startswith("Bearer")
    err = res.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert err["param"] is None and err["message"]


def test_missing_wrong_and_valid_keys(redis_server, upstream, edge_factory) -> None:
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node()))

    assert_invalid_key(post(edge, None))
    assert_invalid_key(post(edge, "ig-not-a-key"))
    assert_invalid_key(post(edge, key + "x"))
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10,
                        headers={"Authorization": f"Basic {key}"})
    assert_invalid_key(res)
    assert "Bearer scheme" in res.json()["error"]["message"]
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10,
                        headers={"Authorization": key})             # the key alone
    assert_invalid_key(res)
    assert "no 'Bearer ' before the key" in res.json()["error"]["message"]
    assert "didn't provide" in post(edge, None).json()["error"]["message"]
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10,
                        headers={"Authorization": "Bearer "})             # the scheme alone
    assert_invalid_key(res)
    assert "didn't provide" in res.json()["error"]["message"]
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10,
                        headers={"Authorization": "Bearer " + "k" * 5000})
    assert_invalid_key(res)
    assert upstream.headers == [], "no rejected request reaches a node"

    res = post(edge, key)
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["message"]["content"] == "ok"
    # the scheme is case-insensitive; GET /v1/models needs the key as well
    res = requests.get(f"{edge.url}/v1/models", headers={"Authorization": f"bearer {key}"}, timeout=10)
    assert res.status_code == 200, res.text
    assert_invalid_key(requests.get(f"{edge.url}/v1/models", timeout=10))
    # the key is not passed on to the nodes
    assert len(upstream.headers) == 2
    assert all("authorization" not in h for h in upstream.headers)

    st = edge.status()["admission"]
    assert st["auth_rejected"] == 9 and st["auth_unavailable"] == 0

    # the key appears in no log line, neither does the bogus one
    logs = edge.access_log() + edge.error_log()
    assert "POST /v1/chat/completions" in edge.access_log()
    assert key not in logs and key[3:20] not in logs and "ig-not-a-key" not in logs


def test_a_key_in_x_api_key_is_taken_and_never_passed_on(redis_server, upstream,
                                                           edge_factory) -> None:
    """Anthropic's SDK sends its key in ``x-api-key``: without an Authorization header
    that header is the key (a wrong one is a 401 like any other), neither header reaches
    the node, and an Authorization header, when sent, is the one checked."""
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node()))
    url = f"{edge.url}/v1/chat/completions"
    res = requests.post(url, json=CHAT, headers={"x-api-key": key}, timeout=10)
    assert res.status_code == 200, res.text
    res = requests.post(url, json=CHAT, headers={"x-api-key": f"Bearer {key}"}, timeout=10)
    assert res.status_code == 200, res.text
    assert_invalid_key(requests.post(url, json=CHAT, headers={"x-api-key": key + "x"},
                                     timeout=10))
    both = requests.post(url, json=CHAT, timeout=10,
                         headers={"x-api-key": key, "Authorization": "Bearer ig-wrong"})
    assert_invalid_key(both)
    assert "x-api-key" in post(edge, None).json()["error"]["message"]
    proxied = [h for h in upstream.headers if "x-request-id" in h]   # not the edge's checks
    assert len(proxied) == 2
    assert all(h not in proxied[0] for h in ("authorization", "x-api-key"))


def test_revoked_key_stops_within_the_cache_interval(redis_server, upstream, edge_factory) -> None:
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme")
    ttl = 2.0
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=ttl))
    assert post(edge, key).status_code == 200
    cached_at = time.monotonic()
    apikeys.revoke_key(r, rec.id)
    revoked_at = time.monotonic()
    # still cached: the edge has not asked Redis again
    res = post(edge, key)
    if time.monotonic() - cached_at < ttl:
        assert res.status_code == 200, res.text
    # within the interval (plus slack for a slow machine) it is refused
    first_401 = None
    while time.monotonic() - revoked_at < ttl + 3:
        res = post(edge, key)
        if res.status_code == 401:
            first_401 = time.monotonic()
            break
        assert res.status_code == 200, res.text
        time.sleep(0.1)
    assert first_401 is not None, "revoked key still accepted after the cache interval"
    assert first_401 - cached_at >= ttl * 0.9, "the edge trusted its cached answer"
    assert_invalid_key(res)
    # and stays refused (negative answers are cached too)
    assert_invalid_key(post(edge, key))


def test_redis_down_cached_keys_work_unknown_keys_get_503(redis_server, upstream, edge_factory) -> None:
    """Redis unreachable: a key with a cached answer works (stale), a known-bad one stays
    bad, a key of the store the edge never saw is checked against the records the edge
    holds (knownkeys: 200, or 401 when it was revoked), and only a key found nowhere gets
    503 auth_unavailable."""
    r = redis_server.client()
    known, _ = apikeys.create_key(r, "acme")
    other, _ = apikeys.create_key(r, "acme")
    gone, gone_rec = apikeys.create_key(r, "acme")
    apikeys.revoke_key(r, gone_rec.id)
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.2,
                                      negative_ttl_s=0.2, stale_ttl_s=60.0))
    procs.wait_until(lambda: _hgetall_calls(r) >= 1, 10, what="the key store's records read")
    assert post(edge, known).status_code == 200
    assert_invalid_key(post(edge, "ig-bogus"))
    redis_server.stop()
    time.sleep(0.3)  # let the cached answers age past cache_ttl_s: they are now stale

    for i in range(3):
        assert post(edge, known).status_code == 200  # stale answer used while Redis is down
        assert_invalid_key(post(edge, "ig-bogus"))  # known-bad stays bad
        assert post(edge, other).status_code == 200  # never seen: the store's record
        assert_invalid_key(post(edge, gone))  # revoked in the record
        res = post(edge, f"ig-never-issued-{i}")  # in no record: cannot be checked
        assert res.status_code == 503, res.text
        err = res.json()["error"]
        assert err["code"] == "auth_unavailable" and err["type"] == "service_unavailable"
        assert res.headers["Retry-After"] == "1"
    adm = edge.status()["admission"]
    assert adm["auth_unavailable"] == 3 and adm["auth_static"] == 6
    assert "Redis unreachable for API keys" in edge.error_log()
    assert all("authorization" not in h for h in upstream.headers)


def test_a_key_revoked_before_redis_went_down_stays_refused(redis_server, upstream,
                                                             edge_factory) -> None:
    """A key the edge cached as valid and that was revoked while Redis answered is refused
    during a later outage (it was accepted on its stale answer for up to stale_ttl_s): the
    key store's records the worker read after the revocation outrank the older cached
    answer. A key still valid keeps working on its stale answer."""
    r = redis_server.client()
    revoked, rec = apikeys.create_key(r, "acme")
    valid, _ = apikeys.create_key(r, "acme")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.2,
                                      negative_ttl_s=0.2, stale_ttl_s=60.0))
    procs.wait_until(lambda: _hgetall_calls(r) >= 1, 10, what="the key store's records read")
    assert post(edge, revoked).status_code == 200
    assert post(edge, valid).status_code == 200
    calls = _hgetall_calls(r)
    apikeys.revoke_key(r, rec.id)
    procs.wait_until(lambda: _hgetall_calls(r) > calls, 15,
                     what="the key store's records read after the revocation")
    redis_server.stop()
    time.sleep(0.3)  # the cached answers are stale now, and older than the records read

    for _ in range(3):
        assert_invalid_key(post(edge, revoked))
        assert post(edge, valid).status_code == 200
    assert all("authorization" not in h for h in upstream.headers)


def _hgetall_calls(r: Any) -> int:
    return int(r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))


def test_auth_off_needs_no_key(redis_server, upstream, edge_factory) -> None:
    edge = edge_factory(edge_settings(redis_server.url, [upstream.node()]))
    assert post(edge, None).status_code == 200
    # a client's own Authorization header passes through untouched when auth is off
    assert post(edge, "whatever").status_code == 200
    assert upstream.headers[-1]["authorization"] == "Bearer whatever"


def _flood(edge: Any, n: int, workers: int = 8) -> list[int]:
    """``n`` requests with distinct made-up keys, ``workers`` at a time; their statuses."""
    from concurrent.futures import ThreadPoolExecutor

    def batch(i: int) -> list[int]:
        with requests.Session() as s:
            return [s.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10,
                           headers={"Authorization": f"Bearer ig-bogus-{i}-{j}"}).status_code
                    for j in range(i, n, workers)]

    with ThreadPoolExecutor(workers) as ex:
        return [c for codes in ex.map(batch, range(workers)) for c in codes]


def _hget_calls(r: Any) -> int:
    return int(r.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))


def _thirty_at_once(r: Any, edge: Any, key: str) -> tuple[list[int], int]:
    """30 requests of ``key`` started together while Redis holds every command for
    60 ms (all their lookups would be in flight at once): their statuses and the HGETs
    Redis got meanwhile."""
    before = _hget_calls(r)
    start = threading.Barrier(30)

    def use(_: int) -> int:
        start.wait()
        return post(edge, key).status_code

    r.execute_command("CLIENT", "PAUSE", 60, "ALL")
    with ThreadPoolExecutor(30) as pool:
        codes = list(pool.map(use, range(30)))
    return codes, _hget_calls(r) - before


@pytest.fixture
def small_auth_dicts_edge(workdir) -> Iterator[Callable[[Settings], Any]]:
    """Like ``edge_factory``, with every ``infergate_auth*`` shared dict shrunk to 64 KB
    (a few hundred answers), so a flood of 3,000 made-up keys overflows the dict it
    lands in."""
    started: list[Any] = []

    def start(settings: Settings) -> Any:
        settings = settings.model_copy(deep=True)
        settings.edge.metrics_listen = f"127.0.0.1:{procs.free_port()}"
        base = workdir / f"small-edge-{len(started)}"
        rendered = render_nginx(settings, base / "conf", listen=f"127.0.0.1:{procs.free_port()}",
                                prefix=base / "prefix")
        http_conf = next(p for p in (base / "conf").rglob("*.conf")
                         if "lua_shared_dict infergate_auth " in p.read_text())
        text = http_conf.read_text()
        text = re.sub(r"(lua_shared_dict infergate_auth\w*) \S+;", r"\1 64k;", text)
        http_conf.write_text(text)
        edge = Edge(rendered, start_nginx(rendered.nginx_conf, rendered.prefix), settings)
        started.append(edge)
        procs.wait_until(lambda: edge.status() is not None, 10, what="edge status endpoint")
        return edge

    try:
        yield start
    finally:
        for edge in started:
            edge.stop()


def test_bogus_key_flood_then_redis_down_valid_keys_still_work(redis_server, upstream,
                                                               small_auth_dicts_edge) -> None:
    """3,000 made-up keys (no per-address limit, so every one costs a lookup) leave the
    valid keys' answers in place although they overflow the dict of unknown keys: with
    Redis stopped right after, the valid keys still get 200 (their answers live apart)."""
    r = redis_server.client()
    keys = [apikeys.create_key(r, f"t{i}")[0] for i in range(5)]
    edge = small_auth_dicts_edge(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.2,
                                               negative_ttl_s=0.2, stale_ttl_s=60.0, fail_burst=0))
    for k in keys:
        assert post(edge, k).status_code == 200
    before = _hget_calls(r)
    codes = _flood(edge, 3000)
    assert codes.count(401) == 3000, {c: codes.count(c) for c in set(codes)}
    assert _hget_calls(r) - before >= 3000  # each made-up key was looked up
    redis_server.stop()
    time.sleep(0.3)  # the valid keys' answers are now stale: only the stale cache holds them
    for k in keys:
        res = post(edge, k)
        assert res.status_code == 200, res.text
    assert edge.status()["admission"]["auth_unavailable"] == 0


def test_failed_lookups_are_limited_per_address(redis_server, upstream, edge_factory) -> None:
    """Past auth.fail_burst failed lookups an address gets a fast 429 auth_throttled
    without a Redis call; a valid key the edge has cached still works from that address,
    and the budget refills at fail_rate_per_s."""
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme")
    burst, rate = 20, 0.5
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), fail_burst=burst,
                                      fail_rate_per_s=rate))
    assert post(edge, key).status_code == 200
    before = _hget_calls(r)
    started = time.monotonic()
    codes = _flood(edge, 1000, workers=4)
    elapsed = time.monotonic() - started
    calls = _hget_calls(r) - before
    assert calls <= burst + rate * elapsed + 4, (calls, elapsed)  # +4: races of the workers
    assert codes.count(401) == calls and codes.count(429) == 1000 - calls
    # right after the flood the budget is spent: at most one token (one per 2 s) can
    # have come back since the flood's last lookup
    later = [post(edge, f"ig-one-more-bogus-{i}") for i in range(3)]
    throttled = [x for x in later if x.status_code == 429]
    assert len(throttled) >= 2, [(x.status_code, x.text) for x in later]
    res = throttled[0]
    err = res.json()["error"]
    assert err["code"] == "auth_throttled" and err["type"] == "rate_limit_error"
    assert int(res.headers["Retry-After"]) >= 1
    assert post(edge, key).status_code == 200  # cached: no lookup, not limited
    assert edge.status()["admission"]["auth_throttled"] >= 1000 - calls
    procs.wait_until(lambda: post(edge, "ig-later-bogus").status_code == 401,
                     2 / rate + 5, what="the address's budget to refill")


def test_a_flood_spread_over_many_addresses_is_limited_as_a_whole(
        redis_server, upstream, edge_factory) -> None:
    """Made-up keys from 150 client addresses, one each (every address within its own
    budget): past the budget of all addresses together (ALL_FACTOR = 50 times an
    address's) they get 429 auth_throttled without a Redis call, and a valid key of the
    store still gets through from a new address meanwhile."""
    import http.client

    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme")
    burst, rate = 2, 0.02                      # all addresses: 100 lookups, 1 a second
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), fail_burst=burst,
                                      fail_rate_per_s=rate))
    port = int(edge.url.rsplit(":", 1)[1])

    def post_from(addr: str, token: str) -> int:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(addr, 0))
        try:
            c.request("POST", "/v1/chat/completions", body=json.dumps(CHAT),
                      headers={"Authorization": f"Bearer {token}",
                               "Content-Type": "application/json"})
            return c.getresponse().status
        finally:
            c.close()

    before = _hget_calls(r)
    started = time.monotonic()
    codes = [post_from(f"127.0.{1 + i // 200}.{1 + i % 200}", f"ig-spread-{i}")
             for i in range(150)]
    elapsed = time.monotonic() - started
    calls = _hget_calls(r) - before
    assert calls <= burst * 50 + rate * 50 * elapsed + 2, (calls, elapsed)
    assert codes.count(401) == calls and codes.count(429) == 150 - calls, codes
    assert post_from("127.0.9.9", key) == 200          # a key of the store: checked


def test_a_new_valid_key_is_not_locked_out_by_a_flood_from_its_address(
        redis_server, upstream, edge_factory) -> None:
    """A flood of made-up keys spends its address's budget of failed lookups. A valid key
    created meanwhile, sent from the same address (clients behind one NAT), is answered
    once the edge's refresh of the key store's digests has it (every 5 s, per worker:
    lua/infergate/admission/knownkeys.lua), not refused until the flood stops; made-up
    keys stay refused without a Redis call."""
    r = redis_server.client()
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), fail_burst=5,
                                      fail_rate_per_s=0.01))
    codes = _flood(edge, 40, workers=4)
    assert codes.count(429) >= 30, codes
    key, _ = apikeys.create_key(r, "behind-the-nat")
    seen: list[int] = []
    procs.wait_until(lambda: seen.append(post(edge, key).status_code) or seen[-1] == 200,
                     15, what="the new key answered from the flooded address")
    assert set(seen) <= {429, 200}, seen
    assert post(edge, key).status_code == 200
    before = _hget_calls(r)
    later = [post(edge, f"ig-still-bogus-{i}").status_code for i in range(5)]
    assert later == [429] * 5 and _hget_calls(r) == before


def test_many_first_requests_of_a_valid_key_share_one_lookup(redis_server, upstream,
                                                              edge_factory) -> None:
    """A client starting many requests at once with a key the edge has not cached: one
    Redis lookup answers them all, so none is taken from the address's budget of failed
    lookups (each lookup in flight used to take one: past the burst, 429 auth_throttled
    for a valid key)."""
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "burst")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), fail_burst=5,
                                      fail_rate_per_s=0.1))
    codes, lookups = _thirty_at_once(r, edge, key)
    assert codes == [200] * 30, sorted(codes)[-3:]
    assert lookups <= 4            # one per worker at most, not 30


@pytest.mark.parametrize("revoked", [False, True])
def test_requests_of_a_key_whose_answer_expired_share_one_lookup(redis_server, upstream,
                                                                 edge_factory, revoked) -> None:
    """Many requests of a busy key (valid or revoked) arriving when its cached answer has
    expired: one Redis lookup renews it for them all (each used to ask Redis itself: 1,000
    connections on one revoked key sent about 300 HGETs every time its answer expired)."""
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "busy")
    if revoked:
        apikeys.revoke_key(r, rec.id)
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.5,
                                      negative_ttl_s=0.5))
    want = 401 if revoked else 200
    with ThreadPoolExecutor(8) as pool:   # an answer cached in every worker
        assert set(pool.map(lambda _: post(edge, key).status_code, range(16))) == {want}
    time.sleep(0.7)                        # ... and expired
    codes, lookups = _thirty_at_once(r, edge, key)
    assert codes == [want] * 30, sorted(codes)
    assert lookups <= 4            # one per worker at most, not 30


def test_a_throttled_key_whose_answer_expired_is_answered_at_once(redis_server, upstream,
                                                                   edge_factory) -> None:
    """An unknown key repeated from an address past its budget of failed lookups, once its
    cached refusal expired: every request gets the 429 without waiting for a lookup. The
    first one takes the lookup's lock and, throttled, lets it go; had it kept it, the
    others would each wait LOOKUP_WAIT_S (0.3 s) for a lookup that never came (counted in
    auth_wait_expired), then get the 429."""
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), fail_burst=3,
                                      fail_rate_per_s=0.01, negative_ttl_s=0.2))
    assert post(edge, "ig-bogus-repeated").status_code == 401   # its refusal cached
    assert [post(edge, f"ig-bogus-{i}").status_code for i in range(2)] == [401, 401]
    assert post(edge, "ig-bogus-spent").status_code == 429      # the budget is spent
    time.sleep(0.3)                                              # ... and the refusal expired
    start = threading.Barrier(12)

    def use(_: int) -> tuple[int, float]:
        start.wait()
        t = time.monotonic()
        code = post(edge, "ig-bogus-repeated").status_code
        return code, time.monotonic() - t

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(use, range(12)))
    assert {code for code, _ in got} == {429}, got
    assert edge.status()["admission"]["auth_wait_expired"] == 0, sorted(s for _, s in got)


def test_redis_back_empty_known_keys_kept_revoked_refused(redis_server, upstream,
                                                          edge_factory) -> None:
    """Redis loses its state (FLUSHALL): the valid keys the edge knew keep working (one
    in use, one idle: known from the key store's records the edge held), the key it saw
    revoked and keys it never saw get 401; the edge says so (error log, status
    auth_store_missing); ``import_keys`` restores the store and Redis decides again."""
    r = redis_server.client()
    known, _ = apikeys.create_key(r, "acme")
    revoked, rec = apikeys.create_key(r, "acme")
    idle, idle_rec = apikeys.create_key(r, "acme")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.2,
                                      negative_ttl_s=0.2, stale_ttl_s=60.0))
    assert post(edge, known).status_code == 200
    assert post(edge, revoked).status_code == 200
    apikeys.revoke_key(r, rec.id)
    procs.wait_until(lambda: post(edge, revoked).status_code == 401, 5,
                     what="the revocation to reach the edge")
    backup = apikeys.export_keys(r)
    r.flushall()
    time.sleep(0.3)  # past cache_ttl_s: every answer is asked of Redis again
    for _ in range(5):  # several cache intervals: the kept answer is renewed
        assert post(edge, known).status_code == 200
        assert post(edge, idle).status_code == 200
        assert_invalid_key(post(edge, revoked))
        assert_invalid_key(post(edge, "ig-never-a-key"))
        time.sleep(0.1)
    adm = edge.status()["admission"]
    assert adm["auth_store_missing"] == 1 and adm["auth_kept"] >= 2
    assert "API KEY STORE MISSING" in edge.error_log()

    apikeys.import_keys(r, backup)
    assert not apikeys.store_missing(r)
    apikeys.revoke_key(r, idle_rec.id)
    procs.wait_until(lambda: post(edge, idle).status_code == 401, 5,
                     what="Redis to decide again")
    assert post(edge, known).status_code == 200
    assert_invalid_key(post(edge, revoked))


def test_a_lost_key_store_stays_reported_while_no_request_comes(redis_server, upstream,
                                                                edge_factory) -> None:
    """Redis loses its state and the clients go quiet: the edge still holds a valid key
    the store lacks, so it goes on reporting the store missing (its refresh of the
    records, not only a request, flags it), the loss stays pending, and a key created
    before the restore neither marks the store written nor gets the kept keys refused."""
    r = redis_server.client()
    known, _ = apikeys.create_key(r, "acme")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.2,
                                      negative_ttl_s=0.2))
    state = edge.rendered.prefix / "infergate-state" / "apikeys.json"
    procs.wait_until(lambda: state.exists() and apikeys.hash_key(known) in state.read_text(),
                     10, what="the key records saved")
    assert post(edge, known).status_code == 200
    r.flushall()
    time.sleep(0.3)
    assert post(edge, known).status_code == 200    # kept: the flag of this request
    time.sleep(12)    # no request for longer than that flag lasts (10 s)
    assert edge.status()["admission"]["auth_store_missing"] == 1
    procs.wait_until(lambda: apikeys.loss_pending(r), 5, what="the edge reporting the loss")

    late, _ = apikeys.create_key(r, "late")
    assert apikeys.store_missing(r), "a key created before the restore ended the loss"
    procs.wait_until(lambda: post(edge, late).status_code == 200, 10,
                     what="the key created after the loss")
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:   # several cache intervals
        assert post(edge, known).status_code == 200
        time.sleep(0.1)


def test_a_deleted_key_is_refused_when_the_store_is_intact(redis_server, upstream,
                                                          edge_factory) -> None:
    from controlplane.redisdb import keynames

    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.2))
    assert post(edge, key).status_code == 200
    r.hdel(keynames.APIKEYS, apikeys.hash_key(key))
    procs.wait_until(lambda: post(edge, key).status_code == 401, 5, what="the key to be refused")
    assert edge.status()["admission"]["auth_kept"] == 0


def test_nginx_restarted_while_redis_is_down_keeps_the_last_state(redis_server, tiny_upstreams,
                                                                  edge_factory) -> None:
    """The edge saves its last routing snapshot and the key store's records
    (edge.state_dir; infergate-state under the prefix here). nginx restarted while Redis
    is unreachable routes on that snapshot (the drained node stays drained, the node added
    at run time is there; not the rendered node list) and admits the keys of the store,
    idle ones included, refusing the revoked ones."""
    a, b = tiny_upstreams(names=["a", "b"])
    r = redis_server.client()
    idle, _ = apikeys.create_key(r, "acme")
    gone, gone_rec = apikeys.create_key(r, "acme")
    apikeys.revoke_key(r, gone_rec.id)
    edge = edge_factory(auth_settings(redis_server.url, a.node_settings()))
    snap = write_snapshot(r, [a.snapshot_node(models=["tiny"], state="draining"),
                              b.snapshot_node(models=["tiny"])])
    edge.wait_snapshot(snap["version"])
    state = edge.rendered.prefix / "infergate-state"
    procs.wait_until(lambda: (state / "routing.json").exists()
                     and (state / "apikeys.json").exists(), 10, what="the state saved")
    assert idle not in (state / "apikeys.json").read_text()
    assert (state / "apikeys.json").stat().st_mode & 0o777 == 0o600
    # a revocation after the save reaches the saved records within a refresh (5 s)
    late, late_rec = apikeys.create_key(r, "acme")
    assert post(edge, late).status_code == 200
    apikeys.revoke_key(r, late_rec.id)
    digest = hashlib.sha256(late.encode()).hexdigest()

    def late_revoked_saved() -> bool:
        rec = json.loads((state / "apikeys.json").read_text()).get(digest)
        return rec is not None and json.loads(rec).get("revoked") is not None

    procs.wait_until(late_revoked_saved, 15, what="the revocation saved")
    redis_server.stop()
    edge.managed.stop()
    edge.managed.start()
    procs.wait_until(lambda: _status_or_none(edge) is not None, 10, what="nginx back")
    st = edge.status()["snapshot"]
    assert st["source"] == "disk" and st["version"] == snap["version"], st
    hits = b.hits
    for _ in range(3):
        res = post(edge, idle)
        assert res.status_code == 200, res.text
        assert res.headers["X-Infergate-Node"] == "b"   # a is drained
    assert b.hits == hits + 3 and a.hits == 0
    assert_invalid_key(post(edge, gone))
    assert_invalid_key(post(edge, late))
    assert post(edge, "ig-never-issued").status_code == 503
    assert "started routing on the snapshot saved last" in edge.error_log()


def test_a_revocation_the_edge_could_not_save_is_saved_once_it_can(redis_server, upstream,
                                                                    edge_factory) -> None:
    """The key records are saved again once the state folder takes writes again (a full
    disk, a folder made read-only for a while): a write that failed is not taken for done,
    so the file never keeps a key revoked since for an nginx started while Redis is down."""
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme")
    edge = edge_factory(auth_settings(redis_server.url, upstream.node()))
    state = edge.rendered.prefix / "infergate-state"
    procs.wait_until(lambda: (state / "apikeys.json").exists(), 10, what="the records saved")
    digest = hashlib.sha256(key.encode()).hexdigest()

    def revoked_saved() -> bool:
        saved = json.loads((state / "apikeys.json").read_text()).get(digest)
        return saved is not None and json.loads(saved).get("revoked") is not None

    mode = state.stat().st_mode
    state.chmod(0o555)          # the workers' user may no longer create files there
    try:
        apikeys.revoke_key(r, rec.id)
        procs.wait_until(lambda: "cannot write" in edge.error_log()
                         or "cannot replace" in edge.error_log(), 15, what="a failed save")
        assert not revoked_saved()
    finally:
        state.chmod(mode & 0o7777)
    procs.wait_until(revoked_saved, 15, what="the revocation saved once the folder takes writes")


def _status_or_none(edge: Any) -> dict | None:
    try:
        return edge.status()
    except requests.RequestException:
        return None


def test_nginx_restarted_while_redis_is_down_then_redis_back_empty_keeps_the_keys(
        redis_server, upstream, edge_factory, workdir) -> None:
    """nginx restarted while Redis is down starts from the saved records; Redis then comes
    back empty (no persistence): the valid keys keep working (the used one and an idle
    one), the revoked and unknown ones get 401, and the refresh of the records (every
    5 s) merges the empty store into what it holds instead of replacing it, in memory and
    in the file. A key write (the restore) makes Redis decide again."""
    from controlplane.admin.apikeys import export_keys, import_keys

    r = redis_server.client()
    used, _ = apikeys.create_key(r, "acme")
    idle, _ = apikeys.create_key(r, "acme")
    gone, gone_rec = apikeys.create_key(r, "acme")
    apikeys.revoke_key(r, gone_rec.id)
    backup = export_keys(r)
    edge = edge_factory(auth_settings(redis_server.url, upstream.node(), cache_ttl_s=0.2,
                                      negative_ttl_s=0.2))
    state = edge.rendered.prefix / "infergate-state" / "apikeys.json"
    digests = {k: hashlib.sha256(k.encode()).hexdigest() for k in (used, idle, gone)}
    procs.wait_until(lambda: state.exists() and all(d in state.read_text()
                                                    for d in digests.values()),
                     10, what="the key records saved")
    assert post(edge, used).status_code == 200
    assert_invalid_key(post(edge, gone))

    redis_server.stop()
    edge.managed.stop()
    edge.managed.start()
    procs.wait_until(lambda: _status_or_none(edge) is not None, 10, what="nginx back")
    assert post(edge, used).status_code == 200     # the records of the file
    redis_server.start_again(workdir / "redis")    # empty: nothing was persisted
    procs.wait_until(lambda: edge.status()["snapshot"]["redis_ok"] is True, 10,
                     what="the edge back on Redis")
    # longer than a refresh of the records (knownkeys.EVERY_S = 5 s)
    deadline = time.monotonic() + 6.5
    while time.monotonic() < deadline:
        assert post(edge, used).status_code == 200
        assert post(edge, idle).status_code == 200
        assert_invalid_key(post(edge, gone))
        assert_invalid_key(post(edge, "ig-never-issued"))
        time.sleep(0.2)
    saved = json.loads(state.read_text())
    assert set(digests.values()) <= set(saved), "the empty store replaced the saved records"
    assert json.loads(saved[digests[gone]])["revoked"] is not None
    adm = edge.status()["admission"]
    assert adm["auth_store_missing"] == 1 and adm["auth_kept"] >= 2

    import_keys(r, backup)   # the store is written again: Redis decides
    apikeys.revoke_key(r, apikeys.lookup(r, idle).id)
    procs.wait_until(lambda: post(edge, idle).status_code == 401, 5,
                     what="the revocation after the restore")
    assert post(edge, used).status_code == 200
