"""The Python side on a 3-master loopback Redis Cluster (one cluster for the module): the
``infergate`` commands (API keys, node registry, drain), two control planes electing one
leader with fencing tokens, the embedder's vectors and sharded pub/sub, and the leader
lease and snapshot writes going on after the routing slot's master is SIGKILLed."""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest
from click.testing import CliRunner

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.cli import main
from controlplane.config import settings_from_dict
from controlplane.embedder.index import IndexItem, LocalIndex, VectorStore, open_index
from controlplane.redisdb import keynames
from controlplane.redisdb.conn import make_redis
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rc(redis_cluster):
    r = make_redis(settings_from_dict({"redis": {"url": redis_cluster.url}}).redis)
    yield r
    r.close()


def _cli(url: str, *args: str):  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(main, [args[0], "--redis-url", url, *args[1:]])
    assert res.exit_code == 0, res.output
    return res.output


def test_cli_keys_and_nodes_on_the_cluster(redis_cluster, rc) -> None:
    out = _cli(redis_cluster.url, "keys", "create", "--tenant", "acme", "--rpm", "60")
    key_id, key = re.search(r"created key ([0-9a-f]{8}) .*\n(ig-\S+)\n", out).groups()
    assert apikeys.lookup(rc, key).rpm == 60
    assert key_id in _cli(redis_cluster.url, "keys", "list")
    _cli(redis_cluster.url, "keys", "revoke", key_id)
    assert apikeys.get_key(rc, key_id).revoked
    assert not apikeys.store_missing(rc)
    _cli(redis_cluster.url, "nodes", "add", "n1", "http://127.0.0.1:9")
    _cli(redis_cluster.url, "nodes", "drain", "n1")
    assert registry.get_state(rc, "n1").state == "draining"
    # the groups' keys really sit on different masters (the cluster is used, not one node)
    slots = {rc.keyslot(k) for k in (keynames.APIKEYS, keynames.NODES, keynames.ROUTING)}
    assert len(slots) == 3


def _cp(url: str, ident: str) -> ControlPlane:
    s = settings_from_dict({"redis": {"url": url},
                            "controlplane": {"leader_ttl_s": 2.0, "poll_timeout_s": 0.2},
                            "nodes": [{"name": "n1", "url": "http://127.0.0.1:9"}]})
    return ControlPlane(s, make_redis(s.redis), ident=ident)


def test_two_control_planes_one_leader_and_failover(redis_cluster, rc) -> None:
    a, b = _cp(redis_cluster.url, "cp-a"), _cp(redis_cluster.url, "cp-b")
    a.run_cycle()
    b.run_cycle()
    assert rc.get(keynames.LEADER) == "cp-a"
    snap = json.loads(rc.get(keynames.ROUTING))
    assert snap["leader"] == "cp-a"
    assert registry.get_state(rc, "n1").state in ("draining", "drained")
    # the routing group's master dies; its replica is promoted and the lease goes on
    # (replicated) or is taken again with a new fencing token
    slot = rc.keyslot(keynames.ROUTING)
    port = _master_port(rc, slot)
    node = redis_cluster.node_of_port(port)
    node.managed.signal(signal.SIGKILL)
    before = snap["version"]

    def written() -> bool:
        for cp in (a, b):
            cp.run_cycle()
        s = rc.get(keynames.ROUTING)
        return s is not None and json.loads(s)["version"] > before

    procs.wait_until(written, 15, interval=0.2, what="a snapshot after the failover")
    holders = {json.loads(rc.get(keynames.ROUTING))["leader"], rc.get(keynames.LEADER)}
    assert len(holders) == 1                      # one leader, and it is the writer
    assert int(rc.get(keynames.LEADER_FENCE)) >= max(a.elector.fence, b.elector.fence)
    for cp in (a, b):
        cp.elector.release()


def _master_port(rc, slot: int) -> int:  # type: ignore[no-untyped-def]
    node = rc.nodes_manager.get_node_from_slot(slot)
    return int(node.port)


def test_embedder_vectors_and_sharded_pubsub_on_the_cluster(redis_cluster) -> None:
    # bytes, as the embedder's own client (controlplane.embedder.engine)
    rc = make_redis(settings_from_dict({"redis": {"url": redis_cluster.url}}).redis,
                    decode_responses=False)
    assert isinstance(open_index(rc, "m", 4, subscribe=False), LocalIndex)  # auto: local
    follower = LocalIndex(rc, "m", 4, subscribe=True)
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
    finally:
        follower.close()
        writer.close()
