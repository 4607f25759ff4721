"""Leader lock against a real redis-server: acquire, renew, expiry, release."""

from __future__ import annotations

import time

import pytest

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.routing.leader import LeaderElector, make_id

pytestmark = pytest.mark.integration


def test_make_id_shape():
    a, b = make_id(), make_id()
    assert a != b
    host, pid, rnd = a.rsplit(":", 2)
    assert host and pid.isdigit() and len(rnd) == 6


def test_one_holder_renews_other_waits(redis_server):
    r = redis_server.client()
    a = LeaderElector(r, "a", ttl_s=5)
    b = LeaderElector(r, "b", ttl_s=5)
    assert a.tick() == (True, True)
    assert b.tick() == (False, False)
    assert a.tick() == (True, False)  # renewal is not a new gain
    assert r.get(keynames.LEADER) == "a"
    assert 0 < r.pttl(keynames.LEADER) <= 5000


def test_renew_extends_only_our_key(redis_server):
    r = redis_server.client()
    a = LeaderElector(r, "a", ttl_s=5)
    a.tick()
    r.set(keynames.LEADER, "intruder", px=5000)  # e.g. a lost lease taken by another
    assert a.tick() == (False, False)
    assert r.get(keynames.LEADER) == "intruder"
    assert a.release() is False
    assert r.get(keynames.LEADER) == "intruder"


def test_expiry_lets_the_other_take_over(redis_server):
    r = redis_server.client()
    a = LeaderElector(r, "a", ttl_s=0.3)
    b = LeaderElector(r, "b", ttl_s=0.3)
    assert a.tick()[0] and not b.tick()[0]
    t0 = time.monotonic()
    procs.wait_until(lambda: b.tick()[0], timeout=3, what="b to take over")
    assert time.monotonic() - t0 < 1.5
    assert b.holder() == "b"
    assert a.tick() == (False, False)


def test_release_hands_over_at_once(redis_server):
    r = redis_server.client()
    a = LeaderElector(r, "a", ttl_s=30)
    b = LeaderElector(r, "b", ttl_s=30)
    a.tick()
    assert a.release() is True
    assert not a.is_leader
    assert b.tick() == (True, True)


def test_retaking_a_lost_key_is_a_new_gain(redis_server):
    r = redis_server.client()
    a = LeaderElector(r, "a", ttl_s=5)
    assert a.tick() == (True, True)
    r.delete(keynames.LEADER)  # e.g. Redis restarted empty while we believed we held it
    assert a.tick() == (True, True)
    assert a.tick() == (True, False)
