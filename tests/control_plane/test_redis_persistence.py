"""Whether the Redis keeps its data across a restart, checked at start
(controlplane/redisdb/persistence.py) by the control plane and ``infergate up``: real
redis-servers without persistence, with an append-only file, with snapshots only, and
with CONFIG refused to the user (ACL)."""

from __future__ import annotations

import logging

import pytest
import redis

from controlplane import procs
from controlplane.config import NodeSettings
from controlplane.redisdb.persistence import check_persistence
from controlplane.routing.service import ControlPlane, make_client
from support.controlplane import cp_settings

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_with(workdir):
    started: list[procs.Managed] = []

    def start(*extra: str, persistent: bool = False) -> redis.Redis:
        m, port = procs.start_redis_free_port(workdir / f"redis-{len(started)}",
                                              persistent=persistent, extra=extra)
        started.append(m)
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2)

    try:
        yield start
    finally:
        for m in started:
            m.stop()


def test_each_kind_of_redis_is_told_apart(redis_with) -> None:
    none = check_persistence(redis_with())
    assert none.level == "none"
    line = none.warning("redis://:secret@127.0.0.1:1/0")
    assert line.startswith("warning: ") and "keeps nothing across a restart" in line
    assert "secret" not in line and "\n" not in line and "appendonly yes" in line
    aof = check_persistence(redis_with(persistent=True))
    assert aof.level == "aof" and aof.warning("redis://127.0.0.1:1/0") is None
    rdb = check_persistence(redis_with("--save", "60 1"))
    assert rdb.level == "rdb" and rdb.save == "60 1"
    assert "only snapshots" in rdb.warning("redis://127.0.0.1:1/0")


def test_config_refused_is_said_not_an_error(redis_with) -> None:
    admin = redis_with()
    admin.acl_setuser("app", enabled=True, passwords=["+app-pw"], keys=["*"],
                      commands=["+@all", "-config"])
    port = admin.connection_pool.connection_kwargs["port"]
    app = redis.Redis(host="127.0.0.1", port=port, username="app", password="app-pw",
                      decode_responses=True, socket_timeout=2)
    found = check_persistence(app)
    assert found.level == "unknown" and "CONFIG GET refused" in found.error
    line = found.warning(f"redis://app:app-pw@127.0.0.1:{port}/0")
    assert line.startswith("note: could not check") and "app-pw" not in line


def test_the_control_plane_warns_once_when_redis_keeps_nothing(redis_with, caplog) -> None:
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    r = redis_with()
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0"
    s = cp_settings([NodeSettings(name="a", url=f"http://127.0.0.1:{procs.free_port()}")])
    s.redis.url = url
    cp = ControlPlane(s, make_client(url, 0.5))
    try:
        cp.run_cycle()
        cp.run_cycle()
        lines = [m for m in caplog.messages if "keeps nothing across a restart" in m]
        assert len(lines) == 1 and cp.persistence.level == "none"
    finally:
        cp.shutdown()
