"""Fixture ``redis_cluster``: one loopback Redis Cluster (3 masters, 3 replicas, append-only
as ``infergate up`` runs Redis) per test module, from
:func:`controlplane.redisdb.localcluster.start_local_cluster`; at the end of the module
stopped, checked to have left no process running, and its folder removed."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.redisdb.localcluster import LocalCluster, start_local_cluster


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """A ready 3+3 loopback cluster (``.url`` is its ``redis+cluster://`` URL,
    ``.client()`` a redis-py ``RedisCluster``), shared by the tests of one module. A
    master found unreachable for 1 s is replaced by its replica (failover drills)."""
    d = Path(tempfile.mkdtemp(prefix="infergate-cluster-"))
    cluster = start_local_cluster(d, persistent=True, node_timeout_ms=1000)
    pids = [n.managed.pid for n in cluster.nodes]
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(d, ignore_errors=True)
    left = []
    for pid in pids:
        try:
            os.kill(pid or 0, 0)
            left.append(pid)
        except ProcessLookupError:
            pass
    assert not left, f"redis-server processes left running after stop: {left}"
