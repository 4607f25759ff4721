"""Redis Sentinel (``redis+sentinel://``) end to end: a password-protected master and
replica, one sentinel that has its own password, a control plane and an edge on
``redis+sentinel://:pw@sentinel/mymaster/2``; then a forced failover (``SENTINEL
FAILOVER``) while the old master stays up -- the hard case: it keeps accepting writes
until the sentinel reconfigures it (up to 10 s), so clients must ask the sentinels
again on their own (every ``redis.sentinel_refresh_s``). The control plane writes to the
promoted replica and the edge follows it (snapshots written after the failover reach the
edge, its stats land on the new master)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.config import Settings
from controlplane.redisdb.conn import make_redis
from support.stack import edge_settings

pytestmark = pytest.mark.integration

PW, SPW, SERVICE = "data-pw", "sentinel-pw", "mymaster"


class SentinelSet:
    """A master, a replica and one sentinel (quorum 1) on free ports."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.ps = procs.ProcessSet()
        self.ports = {"a": procs.free_port(), "b": procs.free_port()}
        self.sentinel_port = procs.free_port()

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[name], password=PW, db=2,
                           decode_responses=True, socket_timeout=2)

    def sentinel(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.sentinel_port, password=SPW,
                           decode_responses=True, socket_timeout=2)

    def master_port(self) -> int:
        return int(self.sentinel().sentinel_get_master_addr_by_name(SERVICE)[1])

    def start(self) -> None:
        a, b = self.ports["a"], self.ports["b"]
        fast = ["--masterauth", PW, "--repl-diskless-sync-delay", "0"]
        self.ps.add(procs.start_redis(self.d / "a", a, extra=fast))
        self.ps.add(procs.start_redis(self.d / "b", b, extra=[
            *fast, "--replicaof", "127.0.0.1", str(a)]))
        for port in (a, b):
            redis.Redis(host="127.0.0.1", port=port).config_set("requirepass", PW)
        procs.wait_until(lambda: self.client("b").info("replication")["master_link_status"] == "up",
                         15, what="replica in sync")
        conf = self.d / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.d}\n"
            f"requirepass {SPW}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {a} 1\n"
            f"sentinel auth-pass {SERVICE} {PW}\n"
            f"sentinel down-after-milliseconds {SERVICE} 2000\n"
            f"sentinel failover-timeout {SERVICE} 10000\n")
        m = self.ps.add(procs.Managed("sentinel", [procs.find_redis_server(), str(conf), "--sentinel"],
                                      self.d / "sentinel.log").start())

        def knows_replica() -> bool:
            reps = self.sentinel().sentinel_slaves(SERVICE)
            return any(int(r["port"]) == b and r.get("master-link-status") == "ok"
                       and "disconnected" not in r["flags"] for r in reps)

        m.wait_ready(knows_replica, 20)

    def failover(self) -> int:
        """Force a failover; returns the new master's port once the sentinel names it."""
        old = self.master_port()

        def asked() -> bool:
            try:
                return bool(self.sentinel().execute_command("SENTINEL", "FAILOVER", SERVICE))
            except redis.ResponseError as exc:
                if "INPROG" in str(exc):
                    return True
                raise  # NOGOODSLAVE: not yet, poll again

        procs.wait_until(asked, 15, interval=0.2, what="sentinel to accept the failover")
        procs.wait_until(lambda: self.master_port() != old, 20, what="sentinel to name a new master")
        return self.master_port()


@pytest.fixture
def sentinels(workdir: Path):
    s = SentinelSet(workdir / "sentinel")
    try:
        s.start()
        yield s
    finally:
        s.ps.stop_all()


def _settings(s: SentinelSet, nodes: list) -> Settings:
    # the first sentinel listed is down: clients go on to the next one
    dead = procs.free_port()
    st = edge_settings(f"redis+sentinel://:{PW}@127.0.0.1:{dead},127.0.0.1:{s.sentinel_port}/{SERVICE}/2",
                       nodes)
    st.redis = st.redis.model_validate({"url": st.redis.url, "sentinel_password": SPW,
                                        "sentinel_refresh_s": 0.5})
    st.controlplane.poll_interval_s = 0.3
    st.controlplane.leader_ttl_s = 2.0
    return st


def test_edge_and_controlplane_follow_a_failover(sentinels, tiny_upstreams, edge_factory,
                                                 controlplane_factory) -> None:
    (up,) = tiny_upstreams(1)
    settings = _settings(sentinels, [up.node_settings()])
    first = sentinels.master_port()
    controlplane_factory(settings, wait_snapshot=False)
    old = sentinels.client("a")
    procs.wait_until(lambda: old.get(keynames.ROUTING) is not None, 20,
                     what="control plane to write a snapshot through the sentinel")
    edge = edge_factory(settings)
    st = edge.wait_snapshot(1)
    assert st["snapshot"]["redis_ok"] is True
    assert first == sentinels.ports["a"]
    # the Python client of the other parts goes through the same URL
    assert make_redis(settings.redis).get(keynames.ROUTING) is not None

    t_failover = time.time()
    new_port = sentinels.failover()
    assert new_port == sentinels.ports["b"]
    new = sentinels.client("b")

    def written_after() -> dict | None:
        raw = new.get(keynames.ROUTING)
        snap = json.loads(raw) if raw else None
        return snap if snap and snap["generated_at"] > t_failover + 0.5 else None

    procs.wait_until(lambda: written_after() is not None, 20,
                     what="control plane to write to the new master")
    version = written_after()["version"]
    st = edge.wait_snapshot(version, timeout=20)
    assert st["snapshot"]["redis_ok"] is True

    def edge_stats_on_new_master() -> bool:
        raw = new.hget(keynames.EDGES, edge.rendered.edge_id)
        return bool(raw) and json.loads(raw)["ts"] > t_failover + 0.5

    procs.wait_until(edge_stats_on_new_master, 10, what="edge stats on the new master")
    # a fresh Python client reaches the new master through the sentinel
    r = make_redis(settings.redis)
    r.set("infergate:test:after-failover", "1")
    assert new.get("infergate:test:after-failover") == "1"


def test_no_sentinel_answering_is_reported(tiny_upstreams, edge_factory) -> None:
    """Every sentinel down: the edge says so and routes on its static node list."""
    (up,) = tiny_upstreams(1)
    dead = procs.free_port()
    edge = edge_factory(edge_settings(f"redis+sentinel://127.0.0.1:{dead}/{SERVICE}", [up.node_settings()]))
    procs.wait_until(lambda: "no sentinel named a master" in str(edge.status()["snapshot"]["redis_error"]),
                     5, what="edge to report that no sentinel answers")
    res = requests.post(edge.url + "/v1/chat/completions", timeout=5,
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert res.status_code == 200
    with pytest.raises(redis.ConnectionError):
        make_redis(edge.settings.redis).ping()
