"""The vector index on real Redis servers: Debian's redis-server 7.0 (no search module ->
in-process index) and Redis 8.2 with redisearch.so (FT.* HNSW index). Synthetic vectors,
no embedding model."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import redis

from controlplane import procs
from controlplane.cache import store as cache_store
from controlplane.redisdb import keynames
from controlplane.embedder.index import (IndexItem, LocalIndex, RedisSearchIndex, open_index,
                                         search_available)
from controlplane.embedder.redis_search import SearchRedisMissing, start_search_redis

DIM = 16


def hx(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def unit(*vals: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[:len(vals)] = vals
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module", params=["local", "redis-search"])
def server(request):
    """(backend name, port) of a fresh Redis for that backend."""
    d = Path(tempfile.mkdtemp(prefix="infergate-vec-"))
    port = procs.free_port()
    try:
        if request.param == "local":
            m = procs.start_redis(d, port)
        else:
            try:
                m = start_search_redis(d, port)
            except SearchRedisMissing as exc:
                pytest.skip(f"Redis with search not installed: {exc}")
        try:
            yield request.param, port
        finally:
            m.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def r(server) -> redis.Redis:
    return redis.Redis(port=server[1], socket_timeout=2)


@pytest.fixture
def index(server, r, request):
    slug = "m" + hx(request.node.name)[:8]  # one model per test: no leftovers between tests
    idx = open_index(r, slug, DIM, server[0])
    assert idx.backend == server[0]
    yield idx
    idx.close()


def add(idx, key: str, ns: str, vec: np.ndarray, ttl: int = 60, text: str = "") -> int:
    return idx.add([IndexItem(key, ns, text or key, ttl)], vec[None, :])[0]


def test_backend_probe(server, r) -> None:
    assert search_available(r) is (server[0] == "redis-search")
    if server[0] == "local":
        with pytest.raises(ValueError, match="no search module"):
            open_index(r, "x", DIM, "redis-search")
    auto = open_index(r, "probe", DIM, "auto", subscribe=False)
    assert isinstance(auto, RedisSearchIndex if server[0] == "redis-search" else LocalIndex)
    auto.close()


def test_nearest_first_inside_namespace_only(index) -> None:
    ns, other = hx("ns-a"), hx("ns-b")
    a, b, c = hx("a"), hx("b"), hx("c")
    add(index, a, ns, unit(1, 0), text="alpha")
    add(index, b, ns, unit(1, 1), text="beta")
    add(index, c, other, unit(1, 0.01), text="gamma")
    res = index.search(ns, unit(1, 0.1), 3)
    assert [x.key for x in res] == [a, b]
    assert res[0].text == "alpha"
    assert res[0].similarity == pytest.approx(float(unit(1, 0) @ unit(1, 0.1)), abs=1e-4)
    assert res[1].similarity == pytest.approx(float(unit(1, 1) @ unit(1, 0.1)), abs=1e-4)
    assert [x.key for x in index.search(other, unit(1, 0.1), 3)] == [c]
    assert index.search(hx("empty"), unit(1, 0), 3) == []


def test_search_many_answers_each_query_as_search_does(index) -> None:
    """Queries of several namespaces in one call (the local index scores a namespace's
    queries in one matrix product): each answer equals that query's own search."""
    ns, other = hx("many-a"), hx("many-b")
    for i in range(12):
        add(index, hx(f"m{i}"), ns, unit(1, i / 6), text=f"t{i}")
    add(index, hx("o1"), other, unit(0, 1), text="other")
    queries = [(ns, unit(1, 0.05)), (other, unit(1, 1)), (hx("nothing"), unit(1, 0)),
               (ns, unit(1, 1.9)), (ns, unit(0, 1))]
    many = index.search_many(queries, 3)
    assert len(many) == len(queries)
    for (q_ns, q_vec), got in zip(queries, many):
        one = index.search(q_ns, q_vec, 3)
        assert [c.key for c in got] == [c.key for c in one]
        assert [c.similarity for c in got] == pytest.approx([c.similarity for c in one],
                                                            abs=1e-5)
    assert [c.key for c in many[0]] == [hx("m0"), hx("m1"), hx("m2")]
    assert many[2] == [] and [c.key for c in many[1]] == [hx("o1")]


def test_top_k_bounds_answers(index) -> None:
    ns = hx("many")
    for i in range(10):
        add(index, hx(f"k{i}"), ns, unit(1, i / 10))
    res = index.search(ns, unit(1, 0), 3)
    assert [x.key for x in res] == [hx("k0"), hx("k1"), hx("k2")]


def test_ttl_follows_the_entry_and_a_late_job_never_extends_it(index, r) -> None:
    ns, k = hx("ttl"), hx("ttl-key")
    r.set(keynames.cache_entry(k), "{}", ex=30)
    applied = add(index, k, ns, unit(0, 1), ttl=300)
    assert 25_000 < applied <= 30_000  # capped by the entry's own remaining TTL
    hk = index.store.hash_key(k)
    assert 0 < r.pttl(hk) <= 30_000
    r.set(keynames.cache_entry(k), "{}", ex=300)   # the entry stored again: 300 s more
    applied = add(index, k, ns, unit(0, 1), ttl=300)
    assert 250_000 < applied <= 300_000 and 250_000 < r.pttl(hk) <= 300_000
    r.set(keynames.cache_entry(k), "{}", ex=30)
    r.delete(keynames.cache_entry(k))
    add(index, k, ns, unit(0, 1), ttl=3000)  # a late job for a gone entry never extends it
    assert 0 < r.pttl(hk) <= 300_000


def test_expired_vectors_are_not_returned(index) -> None:
    ns, k = hx("expiring"), hx("expiring-key")
    add(index, k, ns, unit(0, 0, 1), ttl=1)
    procs.wait_until(lambda: index.search(ns, unit(0, 0, 1), 3) == [], timeout=10,
                     what="the expired vector to leave the index")


def test_models_do_not_mix(server, r) -> None:
    one = open_index(r, "model-one", DIM, server[0], subscribe=False)
    two = open_index(r, "model-two", DIM, server[0], subscribe=False)
    try:
        ns = hx("shared-ns")
        add(one, hx("only-one"), ns, unit(1))
        assert [x.key for x in one.search(ns, unit(1), 3)] == [hx("only-one")]
        assert two.search(ns, unit(1), 3) == []
    finally:
        one.close()
        two.close()


@pytest.fixture
def plain(redis_server) -> redis.Redis:
    """Debian's redis-server (conftest), for tests of the in-process index alone."""
    return redis.Redis(port=redis_server.port, socket_timeout=2)


def test_local_index_loads_at_start_and_follows_other_writers(plain) -> None:
    r = plain
    ns = hx("follow")
    writer = LocalIndex(r, "follow-model", DIM, subscribe=False)
    add(writer, hx("before"), ns, unit(1, 0))
    reader = LocalIndex(r, "follow-model", DIM)  # loads what is in Redis now
    try:
        assert [x.key for x in reader.search(ns, unit(1, 0), 3)] == [hx("before")]
        add(writer, hx("after"), ns, unit(0, 1))  # published on the vector channel
        procs.wait_until(lambda: hx("after") in [x.key for x in reader.search(ns, unit(0, 1), 3)],
                         timeout=10, what="the reader to see the new vector")
    finally:
        reader.close()
        writer.close()


def test_local_index_replaces_and_compacts(plain) -> None:
    r = plain
    idx = LocalIndex(r, "compact-model", DIM, subscribe=False, clock=lambda: 1000.0)
    try:
        ns = hx("compact")
        for i in range(20):
            idx.put(hx(f"r{i}"), ns, f"t{i}", unit(1, i), expires_at=1000.5 if i % 2 else 2000)
        idx.put(hx("r0"), ns, "t0-new", unit(0, 1), expires_at=2000)  # replace, not duplicate
        assert len(idx) == 20
        idx._clock = lambda: 1001.0  # the odd rows have expired
        res = idx.search(ns, unit(0, 1), 50)
        assert len(res) == 10 and len(idx) == 10
        assert res[0].key == hx("r0") and res[0].text == "t0-new"
        assert all(int(x.text.split("-")[0][1:]) % 2 == 0 for x in res)
    finally:
        idx.close()


def test_reindex_reports_the_ttl_in_force(index) -> None:
    ns, k = hx("reindex"), hx("reindex-key")
    first = add(index, k, ns, unit(1, 1, 1), ttl=20)
    again = add(index, k, ns, unit(1, 1, 1), ttl=500)
    assert 0 < again <= first <= 20_000
    assert [x.key for x in index.search(ns, unit(1, 1, 1), 3)] == [k]  # replaced, not doubled


def _entry_and_vector(dec: redis.Redis, writer: LocalIndex, key: str, ns: str,
                      vec: np.ndarray) -> None:
    """A cache entry (as the edge stores it) and its vector (as the embedder does)."""
    cache_store.store(dec, key, tenant="acme", model="m", namespace=ns, body="answer", ttl=300)
    add(writer, key, ns, vec, ttl=300)


def test_a_purged_entry_leaves_other_processes_indexes_unsearched(plain, redis_server) -> None:
    """The purge announces the vectors it deleted on the vector channel: a follower drops
    the row at once, without that namespace being searched (its round-robin check of
    Redis is off here, so the announcement alone does it)."""
    r, dec = plain, redis_server.client()
    ns, gone, kept = hx("purged-ns"), hx("purged"), hx("kept")
    writer = LocalIndex(r, "purge-model", DIM, subscribe=False)
    follower = LocalIndex(r, "purge-model", DIM, upkeep=False)
    try:
        _entry_and_vector(dec, writer, gone, ns, unit(1, 0))
        _entry_and_vector(dec, writer, kept, hx("other-ns"), unit(0, 1))
        procs.wait_until(lambda: len(follower) == 2, 10, what="both vectors followed")
        assert cache_store.purge_counts(dec, namespace=ns) == cache_store.PurgeCount(1, 1)
        procs.wait_until(lambda: len(follower) == 1, 10,
                         what="the purged row to leave the follower's index")
        assert follower.namespaces == 1
        assert [c.key for c in follower.search(hx("other-ns"), unit(0, 1), 3)] == [kept]
    finally:
        follower.close()
        writer.close()


def test_rows_whose_keys_were_evicted_leave_the_index(plain, redis_server) -> None:
    """A vector hash gone without any announcement (evicted, or deleted by hand): the
    index's own check of its rows in Redis drops the row within seconds, with no search
    of its namespace."""
    r, dec = plain, redis_server.client()
    ns, k = hx("evicted-ns"), hx("evicted")
    writer = LocalIndex(r, "evict-model", DIM, subscribe=False)
    idx = LocalIndex(r, "evict-model", DIM)
    try:
        _entry_and_vector(dec, writer, k, ns, unit(1, 1))
        _entry_and_vector(dec, writer, hx("stays"), ns, unit(1, 0))
        procs.wait_until(lambda: len(idx) == 2, 10, what="both vectors followed")
        r.delete(idx.store.hash_key(k))  # no PUBLISH
        procs.wait_until(lambda: len(idx) == 1, 10, what="the evicted row to leave")
        assert [c.key for c in idx.search(ns, unit(1, 1), 3)] == [hx("stays")]
    finally:
        idx.close()
        writer.close()
