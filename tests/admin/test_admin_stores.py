"""API-key and response-cache store modules against a real redis-server."""

from __future__ import annotations

import hashlib
import json

import pytest
import redis

from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.redisdb import keynames


# ---- API keys --------------------------------------------------------------------------


def test_key_is_stored_hashed_and_looked_up_by_hash(r):
    key, rec = apikeys.create_key(r, "acme", rpm=120, tpm="5000", label="batch jobs", now=100.0)
    assert key.startswith("ig-") and len(key) == 3 + 43
    assert len(rec.id) == 8 and rec.id not in key
    digest = hashlib.sha256(key.encode()).hexdigest()
    stored = json.loads(r.hget(keynames.APIKEYS, digest))
    assert stored == {"id": rec.id, "tenant": "acme", "label": "batch jobs", "rpm": 120,
                      "tpm": 5000, "weight": None, "priority": None, "created": 100.0,
                      "revoked": None}
    assert r.hget(keynames.APIKEY_IDS, rec.id) == digest
    dump = json.dumps({k: r.dump(k).hex() for k in (keynames.APIKEYS, keynames.APIKEY_IDS)})
    assert key not in dump and key.encode().hex() not in dump
    assert apikeys.lookup(r, key) == rec
    assert apikeys.lookup(r, key + "x") is None and apikeys.lookup(r, "") is None


def test_keys_are_unique_and_listed_newest_first(r):
    made = [apikeys.create_key(r, "t", now=float(i)) for i in range(5)]
    assert len({k for k, _ in made}) == 5 and len({rec.id for _, rec in made}) == 5
    assert [k.id for k in apikeys.list_keys(r)] == [rec.id for _, rec in reversed(made)]


def test_revoke_and_limits(r):
    key, rec = apikeys.create_key(r, "acme")
    assert apikeys.set_limits(r, rec.id, rpm=10).rpm == 10
    assert apikeys.set_limits(r, rec.id, tpm=7).rpm == 10  # untouched fields kept
    assert apikeys.set_limits(r, rec.id, rpm=None).rpm is None
    first = apikeys.revoke_key(r, rec.id, now=50.0)
    assert first.revoked == 50.0 and not first.active
    assert apikeys.revoke_key(r, rec.id, now=60.0).revoked == 50.0  # idempotent
    assert apikeys.lookup(r, key) is None
    assert apikeys.get_key(r, rec.id).revoked == 50.0
    assert apikeys.list_keys(r, include_revoked=False) == []
    assert apikeys.revoke_key(r, "00000000") is None and apikeys.get_key(r, "../x") is None
    assert apikeys.set_limits(r, "00000000", rpm=1) is None


def test_a_key_whose_id_index_was_lost_is_still_revoked_by_id(r):
    """The id index evicted (or deleted) while the records stayed: the key listed with
    its id is found, revoked and edited by that id, and the index entry is written back."""
    key, rec = apikeys.create_key(r, "acme")
    other, _ = apikeys.create_key(r, "acme")
    r.delete(keynames.APIKEY_IDS)
    assert [k.id for k in apikeys.list_keys(r) if k.id == rec.id] == [rec.id]
    assert apikeys.get_key(r, rec.id).id == rec.id
    revoked = apikeys.revoke_key(r, rec.id, now=70.0)
    assert revoked is not None and revoked.revoked == 70.0
    assert apikeys.lookup(r, key) is None and apikeys.lookup(r, other) is not None
    assert r.hget(keynames.APIKEY_IDS, rec.id) == apikeys.hash_key(key)
    assert apikeys.revoke_key(r, "00000000") is None


@pytest.mark.parametrize("kw,frag", [
    ({"tenant": ""}, "tenant"), ({"tenant": "a:b"}, "tenant"), ({"tenant": None}, "tenant"),
    ({"tenant": "t", "rpm": 0}, "rpm"), ({"tenant": "t", "tpm": -5}, "tpm"),
    ({"tenant": "t", "rpm": 2.5}, "rpm"), ({"tenant": "t", "rpm": "x"}, "rpm"),
    ({"tenant": "t", "rpm": 10**12}, "rpm"), ({"tenant": "t", "label": "a\nb"}, "label"),
    # a trailing newline is not the end of the name; infinity is no number of requests
    ({"tenant": "t\n"}, "tenant"), ({"tenant": "t", "rpm": float("inf")}, "rpm"),
    ({"tenant": "t", "tpm": -float("inf")}, "tpm"),
    # a lone surrogate (a command line that is not UTF-8), bidi override, zero-width space
    ({"tenant": "t", "label": "x\ud800"}, "label"), ({"tenant": "t", "label": "\u202eabc"}, "label"),
    ({"tenant": "t", "label": "a\u200bb"}, "label"), ({"tenant": "t", "label": "web\u2028x"}, "label"),
])
def test_bad_key_input(r, kw, frag):
    tenant = kw.pop("tenant")
    with pytest.raises(apikeys.ApiKeyError, match=frag):
        apikeys.create_key(r, tenant, **kw)
    assert r.hlen(keynames.APIKEYS) == 0 and r.hlen(keynames.APIKEY_IDS) == 0


# ---- response cache --------------------------------------------------------------------


def fill(r):
    """12 entries: tenant t0..t2 (i % 3), model m0/m1 (i % 2), namespace ns0..ns3 (i % 4)."""
    for i in range(12):
        cache_store.store(r, f"{i:064x}", tenant=f"t{i % 3}", model=f"m{i % 2}",
                          namespace=f"ns{i % 4}", body=f"answer {i}", ttl=600, now=1000.0)


def live_entries(r) -> set[int]:
    out = set()
    for k in r.scan_iter(match=keynames.CACHE_ENTRY_PREFIX + "*"):
        out.add(int(k.rsplit(":", 1)[1], 16))
    return out


def test_store_layout(r):
    cache_store.store(r, "ab" * 32, tenant="acme", model="llama", namespace="acme/llama",
                      body='{"x": 1}', ttl=60, now=5.0, stream=True)
    k = keynames.cache_entry("ab" * 32)
    assert k == "infergate:v1:cache:entry:" + "ab" * 32
    doc = json.loads(r.get(k))
    assert doc == {"tenant": "acme", "model": "llama", "namespace": "acme/llama", "created": 5.0,
                   "ttl": 60, "body": '{"x": 1}', "stream": True}
    assert 0 < r.ttl(k) <= 60
    assert r.smembers("infergate:v1:cache:idx:tenant:acme") == {"ab" * 32}
    assert r.smembers(keynames.cache_index("namespace", "acme/llama")) == {"ab" * 32}
    assert r.hget(keynames.CACHE_STATS, "stores") == "1"
    for bad in [dict(exact_key_hex="XYZ"), dict(ttl=0), dict(tenant="")]:
        args = dict(exact_key_hex="cd" * 32, tenant="t", model="m", namespace="n", body="",
                    ttl=10) | bad
        with pytest.raises(cache_store.CacheStoreError):
            cache_store.store(r, **args)


def test_stats(r):
    empty = cache_store.stats(r)
    assert empty.entries == 0 and empty.memory_bytes == 0 and empty.hit_rate is None
    fill(r)
    for f, n in [("lookups", 20), ("hits_exact", 5), ("hits_semantic", 3), ("misses", 12),
                 ("bypass", 2)]:
        cache_store.count(r, f, n)
    with pytest.raises(cache_store.CacheStoreError):
        cache_store.count(r, "hits", 1)
    s = cache_store.stats(r)
    assert s.entries == 12 and s.stores == 12 and s.lookups == 20 and s.bypass == 2
    assert s.hit_rate == 0.4 and s.hit_rate_exact == 0.25 and s.hit_rate_semantic == 0.15
    exact = sum(r.memory_usage(k) for k in r.scan_iter(match=keynames.CACHE_ENTRY_PREFIX + "*"))
    assert s.memory_bytes == exact  # all sampled when <= 64 entries
    assert s.redis_used_memory > s.memory_bytes


@pytest.mark.parametrize("scope,gone", [
    ({"tenant": "t0"}, {0, 3, 6, 9}),
    ({"model": "m1"}, {1, 3, 5, 7, 9, 11}),
    ({"namespace": "ns2"}, {2, 6, 10}),
    ({"tenant": "t0", "model": "m1"}, {3, 9}),
    ({"tenant": "t1", "model": "m0", "namespace": "ns0"}, {4}),
    ({"tenant": "nobody"}, set()),
])
def test_purge_by_scope(r, scope, gone):
    fill(r)
    assert cache_store.estimate(r, **scope) >= len(gone)
    assert cache_store.purge(r, **scope, batch=2) == len(gone)
    assert live_entries(r) == set(range(12)) - gone
    # no index still names a purged entry
    for d in cache_store.DIMENSIONS:
        for value, _ in cache_store.index_values(r, d):
            members = {int(m, 16) for m in r.smembers(keynames.cache_index(d, value))}
            assert not members & gone, (d, value)
    assert cache_store.purge(r, **scope) == 0


def test_purge_all_and_stale_members(r):
    fill(r)
    r.delete(keynames.cache_entry(f"{0:064x}"))  # as if expired
    assert cache_store.purge(r, tenant="t0") == 3
    assert not r.sismember(keynames.cache_index("tenant", "t0"), f"{0:064x}")
    assert cache_store.estimate(r, all=True) == 8
    assert cache_store.purge(r, all=True) == 8
    assert live_entries(r) == set()
    assert list(r.scan_iter(match=keynames.CACHE_INDEX_PREFIX + "*")) == []
    assert cache_store.stats(r).stores == 12  # counters survive a purge
    with pytest.raises(cache_store.CacheStoreError):
        cache_store.purge(r)
    with pytest.raises(cache_store.CacheStoreError):
        cache_store.purge(r, tenant="")
    # a lone surrogate cannot be sent to Redis (it was a 500), a newline or an RTL
    # override is no tenant or model the edge writes
    for bad in ({"tenant": "a\ud800"}, {"model": "\udfff"}, {"namespace": "ab\n"},
                {"model": "m\u202e"}):
        with pytest.raises(cache_store.CacheStoreError, match="printable"):
            cache_store.purge(r, **bad)


def test_purge_removes_corrupt_entries_of_the_scanned_index(r):
    fill(r)
    r.set(keynames.cache_entry("ff" * 32), "not json")
    r.sadd(keynames.cache_index("tenant", "t0"), "ff" * 32)
    assert cache_store.purge(r, tenant="t0") == 5
    assert not r.exists(keynames.cache_entry("ff" * 32))


def test_a_limit_edit_racing_a_revocation_never_unrevokes(r, monkeypatch):
    # The edit reads the record, then a revocation (another client) lands before it
    # writes: the edit is redone on the revoked record instead of writing the stale one,
    # and a revoked key is not edited.
    _key, rec = apikeys.create_key(r, "acme", rpm=10)
    kw = r.connection_pool.connection_kwargs
    other = redis.Redis(host=kw["host"], port=kw["port"], decode_responses=True)
    real_load = apikeys._load
    raced: list[bool] = []

    def load_then_revoke(raw):
        out = real_load(raw)
        if not raced:
            raced.append(True)
            monkeypatch.setattr(apikeys, "_load", real_load)
            apikeys.revoke_key(other, rec.id, now=123.0)
        return out

    monkeypatch.setattr(apikeys, "_load", load_then_revoke)
    with pytest.raises(apikeys.KeyRevoked):
        apikeys.set_limits(r, rec.id, rpm=99)
    assert raced
    again = apikeys.get_key(r, rec.id)
    assert again.revoked == 123.0 and again.rpm == 10


def test_key_store_marker_written_with_the_keys_and_missing_after_a_loss(r):
    """Every key write sets the store's marker; the control plane writes it for keys
    stored before the marker existed, and reports the store missing (``apikeys_missing``)
    once Redis lost its state, until the keys are imported again."""
    import time as _time

    from controlplane.config import Settings
    from controlplane.routing.service import ControlPlane

    assert apikeys.store_missing(r)
    key, rec = apikeys.create_key(r, "acme")
    assert not apikeys.store_missing(r)
    backup = apikeys.export_keys(r)
    # keys from before the marker: written for them, nothing reported missing
    r.delete(keynames.APIKEYS_MARKER)
    cp = ControlPlane(Settings(), r)
    try:
        cp._check_apikeys({})
        assert not apikeys.store_missing(r) and cp.apikeys_missing is False
        # Redis came back empty: missing once this process saw the loss
        r.flushall()
        cp._check_apikeys({})
        assert cp.apikeys_missing is False          # no loss seen, no edge keeping keys
        cp.state_losses = 1
        cp._check_apikeys({})
        assert cp.apikeys_missing is True
        assert [e[0] for e in cp._pending] == ["apikeys_missing"]
        # an edge says it keeps keys: listed by the admin view
        report = json.dumps({"ts": _time.time(), "admission": {"auth_store_missing": 1}})
        r.hset(keynames.EDGES, "edge-a", report)
        st = apikeys.store_status(r)
        assert st == {"store_missing": True, "edges_keeping": ["edge-a"]}
        apikeys.import_keys(r, backup)
        cp._check_apikeys(r.hgetall(keynames.EDGES))
        assert cp.apikeys_missing is False and cp._pending[-1][0] == "apikeys_restored"
        assert apikeys.lookup(r, key).id == rec.id
    finally:
        cp.poller.close()
