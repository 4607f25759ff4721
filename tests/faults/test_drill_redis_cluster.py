"""Drill on a 3-master, 3-replica loopback Redis Cluster (one cluster for the module;
its fixture also checks that stopping it leaves no process): the cluster as started (the
single Redis' settings, every slot covered, replicas attached); the ``infergate``
commands (API keys, node registry, drain); the embedder's vectors and sharded pub/sub (a
purge's announcement included); the sweep of the cache's index sets; and the edge (real nginx + Lua, lua/infergate/redis/cluster.lua) with two control planes:
routing snapshot, API keys (401 / 200), a per-key rate limit (429), an exact cache hit, a
drained node, leader election with fencing tokens -- then the master of the routing and
API-key slots SIGKILLed under requests: no failed request, no 401, one leader writing."""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest
import redis
import requests
from click.testing import CliRunner

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.cache.sweep import IndexSweeper
from controlplane.cli import main
from controlplane.config import settings_from_dict
from controlplane.embedder.index import IndexItem, LocalIndex, VectorStore, open_index
from controlplane.redisdb import keynames
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.localcluster import SLOTS
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane
from support.stack import edge_settings, write_snapshot

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rc(redis_cluster):
    r = make_redis(settings_from_dict({"redis": {"url": redis_cluster.url}}).redis)
    yield r
    r.close()


def test_cluster_ready_with_the_single_redis_settings(redis_cluster) -> None:
    assert len(redis_cluster.nodes) == 6 and len(redis_cluster.masters_now()) == 3
    for n in redis_cluster.nodes:
        info = n.cluster_info()
        assert info["cluster_state"] == "ok" and int(info["cluster_slots_ok"]) == SLOTS
        with n.client() as c:
            assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
            assert c.config_get("appendonly")["appendonly"] == "yes"
    for m in redis_cluster.nodes[:3]:
        with m.client() as c:
            assert int(c.info("replication")["connected_slaves"]) == 1


def _cli(url: str, *args: str) -> str:
    res = CliRunner().invoke(main, [args[0], "--redis-url", url, *args[1:]])
    assert res.exit_code == 0, res.output
    return res.output


def test_cli_keys_and_nodes_on_the_cluster(redis_cluster, rc) -> None:
    out = _cli(redis_cluster.url, "keys", "create", "--tenant", "acme", "--rpm", "60")
    key_id, key = re.search(r"created key ([0-9a-f]{8}) .*\n(ig-\S+)\n", out).groups()
    assert apikeys.lookup(rc, key).rpm == 60
    assert key_id in _cli(redis_cluster.url, "keys", "list")
    backup = _cli(redis_cluster.url, "keys", "export")
    _cli(redis_cluster.url, "keys", "revoke", key_id)
    assert apikeys.get_key(rc, key_id).revoked
    res = CliRunner().invoke(main, ["keys", "--redis-url", redis_cluster.url, "import",
                                    "--overwrite", "-"], input=backup)
    assert res.exit_code == 0 and f"kept revoked: {key_id}" in res.output, res.output
    assert apikeys.lookup(rc, key) is None
    assert not apikeys.store_missing(rc)
    _cli(redis_cluster.url, "nodes", "add", "cli-n1", "http://127.0.0.1:9")
    # edits, drains and removals are WATCH/MULTI transactions on the registry's slot
    _cli(redis_cluster.url, "nodes", "edit", "cli-n1", "--weight", "2")
    assert registry.get_node(rc, "cli-n1").weight == 2.0
    _cli(redis_cluster.url, "nodes", "drain", "cli-n1")
    assert registry.get_state(rc, "cli-n1").state == "draining"
    _cli(redis_cluster.url, "nodes", "remove", "cli-n1")
    assert registry.get_node(rc, "cli-n1") is None
    assert rc.hget(keynames.NODE_STATES, "cli-n1") is None
    # the groups' keys really sit in different slots (the cluster is used, not one node)
    assert len({rc.keyslot(k) for k in (keynames.APIKEYS, keynames.NODES, keynames.ROUTING)}) == 3


def test_embedder_vectors_and_sharded_pubsub_on_the_cluster(redis_cluster) -> None:
    # bytes, as the embedder's own client (controlplane.embedder.engine)
    rc = make_redis(settings_from_dict({"redis": {"url": redis_cluster.url}}).redis,
                    decode_responses=False)
    assert isinstance(open_index(rc, "m", 4, subscribe=False), LocalIndex)  # auto: local
    dec = make_redis(settings_from_dict({"redis": {"url": redis_cluster.url}}).redis)
    follower = LocalIndex(rc, "m", 4, subscribe=True, upkeep=False)
    writer = LocalIndex(rc, "m", 4, subscribe=False)
    try:
        items = [IndexItem(key=f"{i:016x}", namespace="a" * 16, text=f"t{i}", ttl_s=60)
                 for i in range(6)]
        vecs = np.eye(6, 4, dtype="float32") + 0.01
        ttls = writer.add(items, vecs)
        assert all(0 < t <= 60000 for t in ttls)
        store = VectorStore(rc, "m", 4)
        assert sum(len(b) for b in store.scan()) == 6          # SCAN over every master
        assert len({rc.keyslot(store.hash_key(it.key)) for it in items}) > 1  # spread
        procs.wait_until(lambda: len(follower) == 6, 5, what="vectors via SSUBSCRIBE")
        hits = follower.search("a" * 16, vecs[2], 1)
        assert hits and hits[0].key == items[2].key
        # a purge announces the vectors it deleted (SPUBLISH): the follower, whose own
        # check of Redis is off, drops that row without a search
        assert cache_store.purge_vectors(dec, {items[2].key}) == 1
        procs.wait_until(lambda: len(follower) == 5, 5, what="the purged row to leave")
        assert follower.search("a" * 16, vecs[2], 1)[0].key != items[2].key
    finally:
        follower.close()
        writer.close()
        dec.close()


def test_index_set_sweep_on_the_cluster(rc) -> None:
    """The sweep's SCAN walks every master, its SSCAN, EXISTS and SREM go to each key's
    node: members of expired entries leave every set, live ones stay."""
    keys = [f"{i:064x}" for i in range(40)]
    for i, k in enumerate(keys):
        cache_store.store(rc, k, tenant=f"sweep-t{i % 4}", model="sweep-m",
                          namespace=f"{i % 5:032x}", body="x", ttl=300)
    sets = [keynames.cache_index("tenant", f"sweep-t{t}") for t in range(4)]
    assert len({rc.keyslot(s) for s in sets}) > 1  # the sets live on several slots
    for k in keys[:30]:
        rc.pexpire(keynames.cache_entry(k), 1)
    procs.wait_until(lambda: not any(rc.exists(keynames.cache_entry(k)) for k in keys[:30]),
                     5, what="the entries to expire")
    sweeper = IndexSweeper(rc)
    removed = 0
    while True:  # other tests' sets may share the walk
        rep = sweeper.run_once()
        removed += rep.removed
        if rep.pass_done:
            break
    assert removed >= 90
    for i, k in enumerate(keys):
        assert rc.sismember(keynames.cache_index("model", "sweep-m"), k) == (i >= 30)
        assert rc.sismember(sets[i % 4], k) == (i >= 30)


def _post(edge, key: str, content: str) -> requests.Response:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "temperature": 0, "messages": [{"role": "user", "content": content}]}
    return requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=15,
                         headers={"Authorization": f"Bearer {key}"})


def _cp(url: str, ident: str, nodes: list) -> ControlPlane:
    s = settings_from_dict({"redis": {"url": url},
                            "controlplane": {"leader_ttl_s": 2.0, "poll_timeout_s": 0.2},
                            "nodes": [n.model_dump() for n in nodes]})
    return ControlPlane(s, make_redis(s.redis), ident=ident)


def _cluster_ok(cluster) -> bool:  # type: ignore[no-untyped-def]
    try:
        cluster.wait_ok(timeout=0.1)
        return True
    except procs.StartError:
        return False


def test_edge_and_control_planes_through_a_master_failover(
        redis_cluster, rc, tiny_upstreams, edge_factory) -> None:
    key, _ = apikeys.create_key(rc, "acme", rpm=6)
    free, rec = apikeys.create_key(rc, "beta", tpm=10**6)   # token reservation on
    a, b = tiny_upstreams(2)
    s = edge_settings(redis_cluster.url, [a.node_settings(), b.node_settings()])
    s.auth.mode = "required"
    s.limits.redis_retry_s = 0.2
    s.limits.global_rpm = 1000   # with the per-key limit: buckets in two slots
    s.cache = s.cache.model_validate({"enabled": True, "semantic": False})
    # node a's slots known: requests pass the fair share's slot queue (and charge its counters)
    snap = write_snapshot(rc, [a.snapshot_node(slots=4), b.snapshot_node(state="drained")])
    edge = edge_factory(s)
    assert edge.wait_snapshot(snap["version"])["snapshot"]["redis_ok"] is True
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
    # charged in Redis per slot group (not locally after a CROSSSLOT error); the refused
    # request's global charge was given back
    assert rc.hget(keynames.ratelimit_global("rpm"), "tokens") is not None
    assert "CROSSSLOT" not in edge.error_log() and "script failed" not in edge.error_log()
    # the tokens reserved and settled in the key's tpm bucket (one slot with its rpm
    # bucket); the fair share's virtual token counters flushed to their one-key hash
    assert rc.hget(keynames.ratelimit_key(rec.id, "tpm"), "tokens") is not None
    procs.wait_until(lambda: {"acme", "beta"} <= set(rc.hkeys(keynames.FAIRSHARE_COUNTERS)), 5,
                     what="the fair-share counters written on the cluster")
    procs.wait_until(lambda: rc.hget(keynames.EDGES, edge.rendered.edge_id) is not None, 5,
                     what="edge stats written on the cluster")
    # two control planes: one leader, with a fencing token
    cps = [_cp(redis_cluster.url, "cp-a", [a.node_settings()]),
           _cp(redis_cluster.url, "cp-b", [a.node_settings()])]
    for cp in cps:
        cp.run_cycle()
    assert rc.get(keynames.LEADER) == "cp-a" and cps[0].elector.fence >= 1
    before = json.loads(rc.get(keynames.ROUTING))
    assert before["leader"] == "cp-a"
    # the master of the routing and API-key slots dies under requests
    slot = rc.keyslot(keynames.ROUTING)
    assert rc.keyslot(keynames.APIKEYS) // 5462 == slot // 5462  # the same (third) master
    port = int(rc.nodes_manager.get_node_from_slot(slot).port)
    # the replica has what was written so far (replication is asynchronous: a master
    # killed before its replica read the API keys loses them, as any Redis failover does;
    # on a loaded host that lag made this drill lose the key it checks last)
    master = redis.Redis(host="127.0.0.1", port=port, password=redis_cluster.password,
                         socket_timeout=5)
    written = master.info("replication")["master_repl_offset"]

    def replicated() -> bool:
        info = master.info("replication")
        return any(isinstance(v, dict) and int(v.get("offset", -1)) >= written
                   for k, v in info.items() if k.startswith("slave"))

    procs.wait_until(replicated, 10, interval=0.05, what="the replica to have the writes")
    master.close()
    redis_cluster.node_of_port(port).managed.signal(signal.SIGKILL)
    codes = []

    def written_again() -> bool:
        codes.append(_post(edge, free, f"during failover {len(codes)}").status_code)
        for cp in cps:
            cp.run_cycle()
        try:
            now = json.loads(rc.get(keynames.ROUTING))
        except Exception:  # noqa: BLE001 - the cluster is failing over
            return False
        return now["version"] > before["version"] and _cluster_ok(redis_cluster)

    procs.wait_until(written_again, 20, interval=0.1, what="a snapshot after the failover")
    assert set(codes) == {200}, codes                # fail-static: no error, no 401
    holders = {json.loads(rc.get(keynames.ROUTING))["leader"], rc.get(keynames.LEADER)}
    assert len(holders) == 1                         # one leader, and it is the writer
    assert int(rc.get(keynames.LEADER_FENCE)) >= max(cp.elector.fence for cp in cps)
    edge.wait_snapshot(json.loads(rc.get(keynames.ROUTING))["version"])
    key2, _ = apikeys.create_key(rc, "gamma")       # written to the promoted master
    procs.wait_until(lambda: _post(edge, key2, "after").status_code == 200, 10,
                     what="a key created after the failover")
    # the API keys' slot moves to another master (as a reshard does): the edge's map is
    # stale, its reads get MOVED and follow it; a key created afterwards authenticates
    _move_slot(redis_cluster, rc.keyslot(keynames.APIKEYS))
    key3, _ = apikeys.create_key(rc, "delta")
    assert _post(edge, key3, "after the move").status_code == 200
    assert _post(edge, free, "still known").status_code == 200
    for cp in cps:
        cp.elector.release()


def _move_slot(cluster, slot: int) -> None:  # type: ignore[no-untyped-def]
    """Move ``slot`` and its keys to another master (redis-cli --cluster reshard's steps)."""
    masters = cluster.masters_now()
    with masters[0].client() as c:
        src_port = next(int(rest[0][1]) for lo, hi, *rest in c.execute_command("CLUSTER", "SLOTS")
                        if lo <= slot <= hi)
    src = cluster.node_of_port(src_port)
    dst = next(m for m in masters if m.port != src_port)
    with src.client() as s, dst.client() as d:
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id)
        keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if keys:
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
    for m in masters:
        with m.client() as c:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id)
