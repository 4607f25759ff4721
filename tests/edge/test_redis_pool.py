"""The edge's Redis connections (lua/infergate/redis/pool.lua) seen from Redis, through a
real nginx edge: requests reuse pooled connections instead of opening new ones, and
``edge.redis_pool_size`` / ``edge.redis_idle_timeout_ms`` bound how many idle
connections a worker keeps and for how long.

Every request costs one Redis call here (the global rate-limit script on a token bucket
of one token per minute, so all but the first are answered 429 by the edge itself,
without a node; a refusal of a requests bucket would be remembered by the worker for up
to a second, a token bucket's is not: a smaller request may fit);
``CLIENT PAUSE`` holds a burst of requests inside Redis so that many connections are
open at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import redis
import requests

from controlplane import procs
from controlplane.config import Settings
from support.stack import edge_settings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
BURST = 16


def _settings(redis_url: str, node, **edge) -> Settings:
    # a Redis call per request (the global token bucket), and a timeout above the pause
    s = edge_settings(redis_url, [node], redis_timeout_ms=3000, **edge)
    s.auth.mode = "off"
    s.limits.global_tpm = 1
    return s


def _post(url: str) -> int:
    return requests.post(f"{url}/v1/chat/completions", json=CHAT, timeout=15).status_code


def _edge_connections(r: redis.Redis) -> int:
    """Connections open to Redis other than this test's own client."""
    me = r.client_id()
    return sum(1 for c in r.client_list() if int(c["id"]) != me)


def _connections_received(r: redis.Redis) -> int:
    return int(r.info("stats")["total_connections_received"])


def _burst(r: redis.Redis, url: str, n: int = BURST) -> None:
    """n requests at once while Redis holds every command for 0.5 s: each needs its own
    connection."""
    r.execute_command("CLIENT", "PAUSE", 500, "ALL")
    with ThreadPoolExecutor(n) as ex:
        codes = list(ex.map(lambda _: _post(url), range(n)))
    assert codes == [429] * n, codes  # decided in Redis: the shared bucket is empty


def test_requests_reuse_pooled_connections(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(_settings(redis_server.url, up.node_settings()))
    r = redis_server.client()
    assert _post(edge.url) == 200
    _burst(r, edge.url)
    held = _edge_connections(r)
    # the pool (64 per worker by default) kept every connection of the burst
    assert held >= BURST, held
    before = _connections_received(r)
    with ThreadPoolExecutor(8) as ex:
        codes = list(ex.map(lambda _: _post(edge.url), range(400)))
    assert codes == [429] * 400
    opened = _connections_received(r) - before
    # 400 requests (and the snapshot syncs meanwhile) on the pooled connections
    assert opened <= 2, opened
    assert _edge_connections(r) <= held + 2
    assert edge.status()["admission"]["limits_local"] == 0  # every decision came from Redis


def test_pool_size_and_idle_timeout_come_from_the_options(redis_server, tiny_upstreams,
                                                           edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(_settings(redis_server.url, up.node_settings(), redis_pool_size=4,
                                  redis_idle_timeout_ms=500))
    r = redis_server.client()
    assert _post(edge.url) == 200
    _burst(r, edge.url)
    # at most 4 idle connections are kept (plus the one a sync may hold right now)
    assert _edge_connections(r) <= 5, r.client_list()
    before = _connections_received(r)
    _burst(r, edge.url)
    # the second burst found only the pooled ones and opened the rest again
    assert _connections_received(r) - before >= BURST - 5
    # idle connections close after redis_idle_timeout_ms; the sync (every 0.1 s) keeps one
    procs.wait_until(lambda: _edge_connections(r) <= 2, 5,
                     what="idle pooled Redis connections to close")
    time.sleep(0.2)
    assert _edge_connections(r) <= 2
    assert edge.status()["admission"]["limits_local"] == 0
