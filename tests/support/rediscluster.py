"""Fixture ``redis_cluster``: one loopback Redis Cluster (3 masters, 3 replicas) per test
module, from :func:`controlplane.redisdb.localcluster.start_local_cluster`; stopped and
its folder removed at the end of the module."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.redisdb.localcluster import LocalCluster, start_local_cluster


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """A ready 3+3 loopback cluster (``.url`` is its ``redis+cluster://`` URL,
    ``.client()`` a redis-py ``RedisCluster``), shared by the tests of one module."""
    d = Path(tempfile.mkdtemp(prefix="infergate-cluster-"))
    cluster = start_local_cluster(d)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(d, ignore_errors=True)
