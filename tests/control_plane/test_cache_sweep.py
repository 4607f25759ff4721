"""The sweep of the response cache's index sets, on a real redis-server: members whose
entry expired leave the tenant, model and namespace sets; the work per run is bounded
and the walk goes on where the last run stopped; a member stored again meanwhile stays;
only the leader control plane sweeps; the namespace hashes lose the sample field
earlier versions kept in them for 30 days."""

from __future__ import annotations

import redis

from controlplane import procs
from controlplane.cache import store as cache_store
from controlplane.cache.sweep import IndexSweeper
from controlplane.config import settings_from_dict
from controlplane.redisdb import keynames
from controlplane.routing.service import ControlPlane


def hx(i: int) -> str:
    return f"{i:064x}"


def idx(dim: str, value: str) -> str:
    return keynames.cache_index(dim, value)


def store_entries(r: redis.Redis, keys: range, tenant: str = "acme", model: str = "m",
                  namespace: str = "ab" * 16) -> None:
    for i in keys:
        cache_store.store(r, hx(i), tenant=tenant, model=model, namespace=namespace,
                          body=f"answer {i}", ttl=300)


def expire(r: redis.Redis, keys: range) -> None:
    """Entries expire (PEXPIRE 1 ms); their index sets keep them as members."""
    pipe = r.pipeline()
    for i in keys:
        pipe.pexpire(keynames.cache_entry(hx(i)), 1)
    pipe.execute()
    procs.wait_until(lambda: not any(r.exists(keynames.cache_entry(hx(i))) for i in keys),
                     timeout=5, what="the entries to expire")


def test_one_sweep_removes_the_members_of_expired_entries(r) -> None:
    store_entries(r, range(30))
    expire(r, range(20))
    assert r.scard(idx("tenant", "acme")) == 30  # the sets still list them
    rep = IndexSweeper(r).run_once()
    assert rep.pass_done and rep.checked == 90 and rep.removed == 60
    for i in range(30):
        for dim, value in (("tenant", "acme"), ("model", "m"), ("namespace", "ab" * 16)):
            assert r.sismember(idx(dim, value), hx(i)) == (i >= 20)
    assert r.ttl(idx("tenant", "acme")) > 0  # still a cache key with its TTL
    expire(r, range(20, 30))
    IndexSweeper(r).run_once()
    assert not r.exists(idx("tenant", "acme"), idx("model", "m"))  # empty: gone


def test_each_run_is_bounded_and_goes_on_where_the_last_stopped(r) -> None:
    for t in range(3):
        store_entries(r, range(t * 400, t * 400 + 400), tenant=f"t{t}", model=f"m{t}",
                      namespace=f"{t:032x}")
    expire(r, range(0, 1200, 2))  # half of each set
    sw = IndexSweeper(r, max_members=500, batch=100)
    runs, checked = [], 0
    while True:
        rep = sw.run_once()
        runs.append(rep)
        checked += rep.checked
        assert rep.checked <= 500 + 100  # the budget, give or take one batch
        if rep.pass_done:
            break
        assert len(runs) < 20
    assert len(runs) >= 7  # 9 sets x 400 members, at most ~600 a run
    assert checked == 3600  # every member once: no run started the walk again
    assert sum(x.removed for x in runs) == 1800
    for t in range(3):
        assert r.scard(idx("tenant", f"t{t}")) == 200


def test_a_member_whose_entry_is_stored_again_meanwhile_stays(r) -> None:
    """The same request answered again while the sweep removes its member: the member
    goes back, and the set keeps a TTL."""
    store_entries(r, range(2))
    expire(r, range(2))

    class StoreAgainOnSrem:
        """The edge stores entry 0 again right as the sweep removes the members."""

        def __init__(self, inner: redis.Redis):
            self.inner = inner

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def srem(self, name: str, *members: str) -> int:
            n = self.inner.srem(name, *members)
            if not self.inner.exists(keynames.cache_entry(hx(0))):
                store_entries(self.inner, range(1))  # after the SREM, before the re-check
                self.inner.srem(name, hx(0))  # this set's SADD came before our SREM
            return n

    rep = IndexSweeper(StoreAgainOnSrem(r), max_members=2).run_once()  # one set
    assert rep.removed == 2 and rep.restored == 1
    first = next(k for k in (idx("tenant", "acme"), idx("model", "m"),
                             idx("namespace", "ab" * 16)) if not r.sismember(k, hx(1)))
    assert r.sismember(first, hx(0)) and 0 < r.ttl(first) <= 300


def test_the_old_sample_field_is_deleted_once(r) -> None:
    ns = "cd" * 16
    r.hset(keynames.cache_ns_stats(ns), mapping={"hits_semantic": 4, "sample": "Q?"})
    r.expire(keynames.cache_ns_stats(ns), 3600)
    sw = IndexSweeper(r)
    assert sw.run_once().legacy_samples == 1
    assert r.hgetall(keynames.cache_ns_stats(ns)) == {"hits_semantic": "4"}
    r.hset(keynames.cache_ns_stats(ns), "sample", "again")
    assert sw.run_once().legacy_samples == 0  # once per sweeper


def test_only_the_leader_sweeps(r) -> None:
    settings = settings_from_dict({"controlplane": {"leader_ttl_s": 5.0}})
    leader = ControlPlane(settings, r, ident="cp-a")
    follower = ControlPlane(settings, r, ident="cp-b")
    try:
        leader.run_cycle()
        follower.run_cycle()
        assert leader.elector.is_leader and not follower.elector.is_leader
        store_entries(r, range(3))
        expire(r, range(3))
        assert follower.run_sweep() is None
        assert r.scard(idx("tenant", "acme")) == 3
        rep = leader.run_sweep()
        assert rep is not None and rep.removed == 9
        assert not r.exists(idx("tenant", "acme"))
    finally:
        leader.shutdown()
        follower.shutdown()

