"""The loopback Redis Cluster helper (controlplane.redisdb.localcluster): ready with all
slots covered, the single Redis' durability settings, replicas attached, and nothing left
running after stop."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controlplane.config import settings_from_dict
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.localcluster import SLOTS, slot_ranges, start_local_cluster

pytestmark = pytest.mark.integration


def test_slot_ranges_cover_every_slot_once() -> None:
    for masters in (1, 3, 5):
        ranges = slot_ranges(masters)
        covered = [s for lo, hi in ranges for s in range(lo, hi + 1)]
        assert covered == list(range(SLOTS))
    with pytest.raises(ValueError):
        slot_ranges(0)


def _check_ready(cluster) -> None:  # type: ignore[no-untyped-def]
    assert len(cluster.nodes) == 6
    assert cluster.url.startswith("redis+cluster://127.0.0.1:")
    assert len(cluster.masters_now()) == 3
    for n in cluster.nodes:
        info = n.cluster_info()
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_slots_assigned"]) == SLOTS
        with n.client() as c:
            assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
            assert c.config_get("appendonly")["appendonly"] == "yes"
    for m in cluster.nodes[:3]:
        with m.client() as c:
            assert int(c.info("replication")["connected_slaves"]) == 1


def test_cluster_ready_spread_and_stopped_without_leftovers(tmp_path: Path) -> None:
    cluster = start_local_cluster(tmp_path, persistent=True)
    pids = [n.managed.pid for n in cluster.nodes]
    try:
        _check_ready(cluster)
        # the one connection factory gives a cluster client for the cluster URL
        rc = make_redis(settings_from_dict({"redis": {"url": cluster.url}}).redis)
        keys = [f"k{i}" for i in range(50)]
        for k in keys:
            rc.set(k, k)
        assert [rc.get(k) for k in keys] == keys
        rc.close()
        counts = [m.client().dbsize() for m in cluster.masters_now()]
        assert all(c > 0 for c in counts), counts   # every master holds some of them
    finally:
        cluster.stop()
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
