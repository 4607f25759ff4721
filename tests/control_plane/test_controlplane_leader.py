"""Two control planes on one Redis: exactly one writes; the other takes over when the
leader stops (released lock: next cycle; vanished leader: about one lock TTL)."""

from __future__ import annotations

import json
import time

import pytest

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane
from support.controlplane import cp_settings, routing, start_sim

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = start_sim(tmp_path_factory.mktemp("sims"), "sim-l")
    yield s
    s.managed.stop()


@pytest.fixture
def pair(redis_server, sim):
    settings = cp_settings([sim.node()], leader_ttl_s=1.0)
    a = ControlPlane(settings, redis_server.client(), ident="cp-a")
    b = ControlPlane(settings, redis_server.client(), ident="cp-b")
    yield a, b
    a.shutdown()
    b.shutdown()


def test_exactly_one_writes_followers_stay_warm(redis_server, pair):
    r = redis_server.client()
    a, b = pair
    for _ in range(3):
        ra, rb = a.run_cycle(), b.run_cycle()
        assert (ra.leader, rb.leader) == (True, False)
        assert ra.wrote and not rb.wrote
        # The follower polls too.
        assert rb.statuses["sim-l"].has_metrics and rb.statuses["sim-l"].healthy
    snap = routing(r)
    assert snap["leader"] == "cp-a" and snap["version"] == 3
    assert r.get(keynames.ROUTING_VERSION) == "3"
    assert r.get(keynames.LEADER) == "cp-a"
    assert [e["detail"]["id"] for e in registry.recent_events(r) if e["kind"] == "leader"] == ["cp-a"]


def test_released_lock_is_taken_at_the_next_cycle(redis_server, pair):
    r = redis_server.client()
    a, b = pair
    a.run_cycle()
    b.run_cycle()
    a.shutdown()
    assert r.get(keynames.LEADER) is None
    rb = b.run_cycle()
    assert rb.leader and rb.wrote
    assert routing(r)["leader"] == "cp-b" and routing(r)["version"] == 2
    leaders = [e["detail"]["id"] for e in registry.recent_events(r) if e["kind"] == "leader"]
    assert leaders == ["cp-b", "cp-a"]


def test_vanished_leader_replaced_within_about_one_ttl(redis_server, pair):
    r = redis_server.client()
    a, b = pair
    a.run_cycle()
    assert not b.run_cycle().leader
    t0 = time.monotonic()  # a stops cycling without releasing (crash, partition)

    def b_writes() -> bool:
        return b.run_cycle().wrote

    procs.wait_until(b_writes, timeout=5, interval=0.1, what="the standby to take over")
    waited = time.monotonic() - t0
    assert 0.5 < waited < 1.8, waited  # TTL 1 s
    assert routing(r)["leader"] == "cp-b"
    # The old leader finds out at its next cycle and does not write.
    ra = a.run_cycle()
    assert not ra.leader and not ra.wrote
    assert json.loads(r.get(keynames.ROUTING))["leader"] == "cp-b"
