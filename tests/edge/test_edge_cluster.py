"""The edge (real nginx + Lua) on a 3-master loopback Redis Cluster, one cluster for the
module: the routing snapshot, API keys (401 / 200), a per-key rate limit (429), an exact
cache hit, and a drained node, through the cluster client of
lua/infergate/redis/cluster.lua; then a master SIGKILLed: the edge keeps serving
(fail-static) and uses the promoted replica."""

from __future__ import annotations

import json
import signal

import pytest
import requests

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.config import settings_from_dict
from controlplane.redisdb import keynames
from controlplane.redisdb.conn import make_redis
from support.stack import edge_settings, write_snapshot

pytestmark = pytest.mark.integration


def _post(edge, key: str, content: str) -> requests.Response:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "temperature": 0, "messages": [{"role": "user", "content": content}]}
    return requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=15,
                         headers={"Authorization": f"Bearer {key}"})


def test_edge_serves_on_the_cluster_and_through_a_failover(
        redis_cluster, tiny_upstreams, edge_factory) -> None:
    rc = make_redis(settings_from_dict({"redis": {"url": redis_cluster.url}}).redis)
    key, _ = apikeys.create_key(rc, "acme", rpm=6)
    free, _ = apikeys.create_key(rc, "beta")
    a, b = tiny_upstreams(2)
    s = edge_settings(redis_cluster.url, [a.node_settings(), b.node_settings()])
    s.auth.mode = "required"
    s.limits.redis_retry_s = 0.2
    s.cache = s.cache.model_validate({"enabled": True, "semantic": False})
    snap = write_snapshot(rc, [a.snapshot_node(), b.snapshot_node(state="drained")])
    edge = edge_factory(s)
    st = edge.wait_snapshot(snap["version"])
    assert st["snapshot"]["redis_ok"] is True
    # API keys: unknown refused, known served, only by the active node
    assert _post(edge, "ig-nope", "x").status_code == 401
    first = _post(edge, free, "What is the capital of France?")
    assert first.status_code == 200, first.text
    assert first.headers["X-Infergate-Node"] == a.name and b.hits == 0
    # the exact cache: stored by the flush timer, then a hit without a node
    procs.wait_until(lambda: _post(edge, free, "What is the capital of France?")
                     .headers.get("X-Cache-Status") == "HIT", 5, what="an exact hit")
    # a per-key limit of 6 requests a minute: the 7th is refused
    codes = [_post(edge, key, f"q{i}").status_code for i in range(7)]
    assert codes == [200] * 6 + [429], codes
    procs.wait_until(lambda: rc.hget(keynames.EDGES, edge.rendered.edge_id) is not None, 5,
                     what="edge stats written on the cluster")
    # the master of the API keys' slot dies: auth goes on from the edge's cache and then
    # from the promoted replica; no 401 for a valid key
    port = int(rc.nodes_manager.get_node_from_slot(rc.keyslot(keynames.APIKEYS)).port)
    redis_cluster.node_of_port(port).managed.signal(signal.SIGKILL)
    codes = []

    def promoted() -> bool:
        codes.append(_post(edge, free, f"during failover {len(codes)}").status_code)
        try:
            return json.loads(rc.get(keynames.ROUTING))["version"] >= snap["version"] and \
                redis_cluster_ok(redis_cluster)
        except Exception:  # noqa: BLE001 - the cluster is failing over
            return False

    procs.wait_until(promoted, 20, interval=0.2, what="the replica promoted")
    assert set(codes) == {200}, codes
    newer = write_snapshot(rc, [a.snapshot_node(), b.snapshot_node()])
    edge.wait_snapshot(newer["version"])
    key2, _ = apikeys.create_key(rc, "gamma")     # written to the promoted master
    procs.wait_until(lambda: _post(edge, key2, "after").status_code == 200, 10,
                     what="a key created after the failover")
    rc.close()


def redis_cluster_ok(cluster) -> bool:  # type: ignore[no-untyped-def]
    try:
        cluster.wait_ok(timeout=0.1)
        return True
    except procs.StartError:
        return False
