"""The phases of a master failover on the loopback cluster, as seen from outside: when
the other nodes flag the killed master ``fail?`` (PFAIL, after ``cluster-node-timeout``
without a reply) and ``fail`` (FAIL, once a majority of masters reported it), when its
replica answers ``ROLE`` as a master, and when every live node reports
``cluster_state:ok`` again. Polled every ``interval_s`` (the figures are that coarse)."""

from __future__ import annotations

import time

import redis

from controlplane.redisdb.localcluster import ClusterNode, LocalCluster


def replica_of(cluster: LocalCluster, master: ClusterNode) -> ClusterNode | None:
    """The live node that replicates ``master`` now (``ROLE``), if any."""
    for n in cluster.nodes:
        if n is master or not n.managed.alive():
            continue
        try:
            with n.client() as c:
                role = c.execute_command("ROLE")
        except redis.RedisError:
            continue
        if role[0] == "slave" and int(role[2]) == master.port:
            return n
    return None


def _flags(cluster: LocalCluster, node_id: str) -> set[str]:
    """Every flag the live nodes' ``CLUSTER NODES`` give ``node_id``."""
    out: set[str] = set()
    for n in cluster.nodes:
        if not n.managed.alive():
            continue
        try:
            with n.client() as c:
                text = c.execute_command("CLUSTER NODES")
        except redis.RedisError:
            continue
        if isinstance(text, dict):   # redis-py parses the reply: {"ip:port": {"node_id", "flags"}}
            for v in text.values():
                if v.get("node_id") == node_id:
                    out |= set(str(v.get("flags", "")).split(","))
            continue
        if isinstance(text, bytes):
            text = text.decode()
        for line in str(text).splitlines():
            parts = line.split()
            if parts and parts[0] == node_id:
                out |= set(parts[2].split(","))
    return out


def _role(node: ClusterNode) -> str | None:
    try:
        with node.client() as c:
            return str(c.execute_command("ROLE")[0])
    except redis.RedisError:
        return None


def watch(cluster: LocalCluster, killed: ClusterNode, replica: ClusterNode | None,
          killed_at: float, timeout_s: float = 30, interval_s: float = 0.02) -> dict:
    """Seconds from ``killed_at`` (``time.time()``) to ``pfail``, ``fail``, ``promoted``
    and ``recovered`` (``None`` for a phase not seen before ``timeout_s``)."""
    out: dict[str, float | None] = {"pfail": None, "fail": None, "promoted": None,
                                    "recovered": None}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and out["recovered"] is None:
        now = time.time() - killed_at
        if out["fail"] is None:
            flags = _flags(cluster, killed.node_id)
            if out["pfail"] is None and ("fail?" in flags or "fail" in flags):
                out["pfail"] = now
            if "fail" in flags:
                out["fail"] = now
        if out["promoted"] is None and replica is not None and _role(replica) == "master":
            out["promoted"] = now
        if out["promoted"] is not None and cluster._all_ok()[0]:
            out["recovered"] = now
        time.sleep(interval_s)
    return {k: (round(v, 2) if v is not None else None) for k, v in out.items()}
