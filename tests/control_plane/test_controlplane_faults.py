"""Failures seen by the control plane: a node refusing connections, failing its health
check, failing its metrics, or stopped; Redis going away mid-run or absent at start.
Real redis-server and simulated nodes, cycles driven directly."""

from __future__ import annotations

import json
import logging

import pytest

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane, make_client
from support.controlplane import cp_settings, routing, start_sim

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = start_sim(tmp_path_factory.mktemp("sims"), "sim-f")
    yield s
    s.managed.stop()


@pytest.fixture
def healthy_sim(sim):
    sim.clear()
    return sim


def healthy_in_snapshot(r, name: str) -> bool:
    return {n["name"]: n["healthy"] for n in routing(r)["nodes"]}[name]


def test_refused_node_unhealthy_after_k_and_back_after_m(redis_server, healthy_sim):
    r = redis_server.client()
    cp = ControlPlane(cp_settings([healthy_sim.node()], unhealthy_after=3, healthy_after=2),
                      redis_server.client())
    try:
        assert cp.run_cycle().statuses["sim-f"].healthy
        healthy_sim.faults(refuse=True)
        seen = []
        for _ in range(3):
            rep = cp.run_cycle()
            seen.append(rep.statuses["sim-f"].healthy)
        assert seen == [True, True, False]
        st = rep.statuses["sim-f"]
        assert st.reachable is False and "refused" in st.last_error
        assert st.consecutive_failures == 3
        assert healthy_in_snapshot(r, "sim-f") is False
        doc = json.loads(r.get(keynames.node_metrics("sim-f")))
        assert doc["healthy"] is False and doc["has_metrics"] is False

        healthy_sim.faults(refuse=False)
        procs.wait_until(healthy_sim.answers, timeout=10, what="listening again")
        seen = [cp.run_cycle().statuses["sim-f"].healthy for _ in range(2)]
        assert seen == [False, True]
        assert healthy_in_snapshot(r, "sim-f") is True

        ev = [e for e in registry.recent_events(r) if e["kind"] == "health"]
        assert [e["detail"]["healthy"] for e in reversed(ev)] == [False, True]
        assert all(e["node"] == "sim-f" for e in ev)
    finally:
        cp.shutdown()


def test_health_503_is_a_failed_poll(redis_server, healthy_sim):
    cp = ControlPlane(cp_settings([healthy_sim.node()], unhealthy_after=2),
                      redis_server.client())
    try:
        healthy_sim.faults(health_fail=True)
        reps = [cp.run_cycle() for _ in range(2)]
        st = reps[-1].statuses["sim-f"]
        assert not st.healthy and st.reachable and "HTTP 503" in st.last_error
        assert st.has_metrics  # /metrics still answered
    finally:
        cp.shutdown()


def test_metrics_500_with_good_health_stays_healthy_without_metrics(redis_server, healthy_sim):
    r = redis_server.client()
    cp = ControlPlane(cp_settings([healthy_sim.node()], unhealthy_after=1),
                      redis_server.client())
    try:
        healthy_sim.faults(metrics_fail=True)
        for _ in range(3):
            st = cp.run_cycle().statuses["sim-f"]
            assert st.healthy and not st.has_metrics
        assert "metrics: HTTP 500" in st.last_error
        doc = json.loads(r.get(keynames.node_metrics("sim-f")))
        assert doc["healthy"] is True and doc["dialect"] is None and doc["queue_depth"] is None
        assert healthy_in_snapshot(r, "sim-f") is True
    finally:
        cp.shutdown()


def test_stopped_node_goes_unhealthy(redis_server, tmp_path):
    s = start_sim(tmp_path, "sim-gone")
    cp = ControlPlane(cp_settings([s.node()], unhealthy_after=2), redis_server.client())
    try:
        assert cp.run_cycle().statuses["sim-gone"].healthy
        s.managed.stop()
        seen = [cp.run_cycle().statuses["sim-gone"].healthy for _ in range(2)]
        assert seen == [True, False]
    finally:
        s.managed.stop()
        cp.shutdown()


def test_redis_down_mid_run_keeps_polling_and_writes_resume(redis_server, healthy_sim, workdir,
                                                            caplog):
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    r = redis_server.client()
    cp = ControlPlane(cp_settings([healthy_sim.node()], unhealthy_after=2),
                      make_client(redis_server.url, 0.5))
    try:
        rep = cp.run_cycle()
        assert rep.wrote and rep.version == 1
        redis_server.stop()
        healthy_sim.faults(refuse=True)
        reps = [cp.run_cycle() for _ in range(3)]
        assert all(not x.redis_ok and not x.wrote for x in reps)
        # Polling went on: the node's failure was noticed without Redis.
        assert [x.statuses["sim-f"].healthy for x in reps] == [True, False, False]
        assert all(x.duration_ms < 3000 for x in reps)
        down = [m for m in caplog.messages if "redis unreachable" in m]
        assert len(down) == 1

        healthy_sim.faults(refuse=False)
        procs.wait_until(healthy_sim.answers, timeout=10, what="listening again")
        redis_server.start_again(workdir / "redis")
        rep = cp.run_cycle()
        assert rep.redis_ok and rep.wrote
        assert [m for m in caplog.messages if "redis reachable again" in m]
        # The restarted Redis was empty: registry re-seeded, snapshot written again.
        assert [n.name for n in registry.list_nodes(r)] == ["sim-f"]
        assert routing(r)["version"] == 1
        # The health change that happened during the outage is recorded now.
        ev = [e for e in registry.recent_events(r) if e["kind"] == "health"]
        assert ev and ev[0]["detail"]["healthy"] is False
        # Leadership was taken again in the new Redis, and said so.
        assert [e["detail"]["id"] for e in registry.recent_events(r)
                if e["kind"] == "leader"] == [cp.id]
        assert sum("leadership acquired" in m for m in caplog.messages) == 2
    finally:
        cp.shutdown()


def test_redis_absent_at_start_uses_configured_nodes(redis_server, healthy_sim, workdir):
    redis_server.stop()
    cp = ControlPlane(cp_settings([healthy_sim.node()]), make_client(redis_server.url, 0.5))
    try:
        rep = cp.run_cycle()
        assert not rep.redis_ok and not rep.wrote
        assert list(rep.statuses) == ["sim-f"] and rep.statuses["sim-f"].has_metrics
        redis_server.start_again(workdir / "redis")
        rep = cp.run_cycle()
        assert rep.wrote and rep.leader
        assert [n["name"] for n in routing(redis_server.client())["nodes"]] == ["sim-f"]
    finally:
        cp.shutdown()


def test_redis_refusing_writes_is_said_as_refusing_not_unreachable(redis_server, healthy_sim,
                                                                   caplog):
    """Redis out of memory with ``noeviction`` answers every write with an error: the
    control plane says Redis refuses its commands (it is there; its memory or its role is
    the fix), not that it is unreachable, and writes again once it accepts them."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    r = redis_server.client()
    cp = ControlPlane(cp_settings([healthy_sim.node()]), make_client(redis_server.url, 0.5))
    try:
        assert cp.run_cycle().wrote
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", "1")
        try:
            rep = cp.run_cycle()
        finally:
            r.config_set("maxmemory", "0")
        assert not rep.wrote
        said = [m for m in caplog.messages if m.startswith("redis ")]
        assert any("redis refuses the control plane's commands" in m and "OutOfMemory" in m
                   for m in said), said
        assert not any("redis unreachable" in m for m in said)
        assert cp.run_cycle().wrote
    finally:
        cp.shutdown()
