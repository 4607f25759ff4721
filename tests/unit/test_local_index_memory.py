"""The in-process vector index's memory stays bounded: small blocks that grow by doubling
and shrink again, expired rows dropped in every namespace (not only in the one searched),
rows whose keys left Redis dropped by the round-robin check, and a ceiling on rows.
fakeredis stands in for Redis; the clock is injected."""

from __future__ import annotations

import gc
import logging
import tracemalloc

import fakeredis
import numpy as np
import pytest

from controlplane.embedder import index as index_mod
from controlplane.embedder.index import LocalIndex
from controlplane.embedder.rows import HEAP_SLACK, RowTable
from controlplane.redisdb import keynames


def hx(i: int, width: int = 64) -> str:
    return f"{i:0{width}x}"


def unit(dim: int, i: int) -> np.ndarray:
    v = np.zeros(dim, dtype=np.float32)
    v[i % dim] = 1.0
    return v


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fr() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def local(fr, clock: Clock, dim: int = 8, **kw) -> LocalIndex:
    return LocalIndex(fr, "m", dim, subscribe=False, clock=clock, **kw)


def test_expired_rows_of_other_namespaces_leave_on_puts_and_searches(fr) -> None:
    clock = Clock()
    idx = local(fr, clock)
    for i in range(200):  # 200 namespaces, one row each, all expiring at 1010
        idx.put(hx(i), hx(i, 32), f"q{i}", unit(8, i), 1010.0)
    for i in range(5):    # and 5 rows that live on
        idx.put(hx(1000 + i), hx(7, 32), f"keep{i}", unit(8, i), 5000.0)
    assert len(idx) == 205
    clock.t = 1011.0
    for i in range(20):   # puts in another namespace: no search of the expired ones
        idx.put(hx(2000 + i), "f" * 32, f"new{i}", unit(8, i), 5000.0)
    for _ in range(10):
        idx.search("e" * 32, unit(8, 0), 3)  # a namespace with no row at all
    assert len(idx) == 25
    assert idx.namespaces == 2  # the 199 namespaces left with no row are deleted


def test_sweep_looks_at_a_bounded_number_of_rows(fr) -> None:
    clock = Clock()
    idx = local(fr, clock)
    for i in range(100):
        idx.put(hx(i), hx(i % 10, 32), "q", unit(8, i), 1001.0 + i)
    clock.t = 1050.5  # rows 0..49 expired
    assert idx.sweep(30) == 30 and len(idx) == 70
    assert idx.sweep(30) == 20 and len(idx) == 50
    assert idx.sweep(30) == 0
    assert {c.key for c in idx.search(hx(3, 32), unit(8, 3), 10)} == {
        hx(i) for i in (53, 63, 73, 83, 93)}


def test_a_replaced_row_keeps_its_new_expiry(fr) -> None:
    clock = Clock()
    idx = local(fr, clock)
    idx.put(hx(1), hx(1, 32), "old", unit(8, 1), 1010.0)
    idx.put(hx(1), hx(2, 32), "new", unit(8, 2), 3000.0)  # same key, another namespace
    clock.t = 2000.0
    while idx.sweep(10):
        pass
    assert len(idx) == 1 and idx.namespaces == 1
    assert [c.text for c in idx.search(hx(2, 32), unit(8, 2), 3)] == ["new"]


def test_the_row_ceiling_drops_the_soonest_expiring_and_logs_once(fr, caplog) -> None:
    clock = Clock()
    idx = local(fr, clock, max_rows=10)
    caplog.set_level(logging.WARNING, logger="infergate.embedder")
    for i in range(15):  # row i expires at 2000 + (i * 7) % 15: not in insertion order
        idx.put(hx(i), hx(i % 3, 32), f"q{i}", unit(8, i), 2000.0 + (i * 7) % 15)
    assert len(idx) == 10 and idx.dropped_over_cap == 5
    kept = {c.key for ns in range(3) for c in idx.search(hx(ns, 32), unit(8, 0), 20)}
    assert kept == {hx(i) for i in range(15) if (i * 7) % 15 >= 5}
    full = [r for r in caplog.records if "index full" in r.getMessage()]
    assert len(full) == 1


def test_blocks_grow_by_doubling_and_give_memory_back() -> None:
    t = RowTable(4, max_rows=1000)
    ns = "a" * 32
    t.put(hx(0), ns, "q", unit(4, 0), 10.0)
    assert t.blocks[ns].capacity == 1
    for i in range(1, 64):
        t.put(hx(i), ns, "q", unit(4, i), 10.0 if i < 60 else 99.0)
    assert t.blocks[ns].capacity == 64
    while t.sweep(20.0, 16):
        pass
    assert len(t) == 4 and t.blocks[ns].capacity <= 16
    for i in range(60, 64):
        t.delete(hx(i))
    assert ns not in t.blocks and len(t) == 0


def test_the_heap_stays_bounded_when_rows_are_replaced() -> None:
    t = RowTable(4, max_rows=1000)
    for n in range(20 * HEAP_SLACK):
        t.put(hx(n % 3), "b" * 32, "q", unit(4, n), 100.0 + n)
    assert len(t) == 3
    assert len(t._heap) <= 2 * len(t) + HEAP_SLACK + 1


def test_rows_whose_keys_left_redis_are_dropped_in_turn(fr) -> None:
    clock = Clock()
    idx = local(fr, clock)
    for i in range(300):
        idx.put(hx(i), hx(i % 30, 32), "q", unit(8, i), 5000.0)
        fr.set(keynames.cache_entry(hx(i)), "{}")
        if i % 3:  # a third of the rows lost their vector hash (purged, evicted)
            fr.hset(idx.store.hash_key(hx(i)), "key", hx(i))
    dropped = 0
    rounds = 0
    while rounds < 10 and len(idx) > 200:
        dropped += idx.verify_some()  # at least VERIFY_BATCH_MIN rows a round
        rounds += 1
    assert dropped == 100 and len(idx) == 200
    assert rounds == -(-300 // index_mod.VERIFY_BATCH_MIN)


def test_memory_per_namespace_is_small_and_given_back(fr) -> None:
    """2000 namespaces of one 512-dimension row each: a few KB per namespace (a block of
    8 rows was 17 KB), and about nothing left once they expired and were swept."""
    clock = Clock()
    vec = np.ones(512, dtype=np.float32) / np.sqrt(512)
    gc.collect()
    tracemalloc.start()
    try:
        idx = local(fr, clock, dim=512)
        base = tracemalloc.get_traced_memory()[0]
        for i in range(2000):
            idx.put(hx(i), hx(i, 32), f"how do I reset my password {i}", vec, 1060.0)
        full = tracemalloc.get_traced_memory()[0] - base
        clock.t = 2000.0
        while idx.sweep():
            pass
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert full / 2000 < 4096, f"{full / 2000:.0f} bytes per namespace"
    assert left < full / 20, f"{left} of {full} bytes still held"
    assert len(idx) == 0 and idx.namespaces == 0


def test_the_engine_gives_its_index_the_configured_ceiling(fr) -> None:
    from controlplane.config import settings_from_dict
    from controlplane.embedder.engine import Engine

    class Model:
        model_id, dim, default_min_similarity = "fake", 8, 0.9

        def encode(self, texts):
            return np.stack([unit(8, len(t)) for t in texts])

    s = settings_from_dict({"cache": {"semantic_index_max_rows": 1234}})
    e = Engine(Model(), fr, index_backend="local", subscribe=False,
               index_max_rows=s.cache.semantic_index_max_rows)
    try:
        assert e.index._rows.max_rows == 1234
        assert settings_from_dict({}).cache.semantic_index_max_rows == 100_000
    finally:
        e.close()


def test_a_row_stored_again_while_redis_is_asked_is_kept(fr) -> None:
    """The check found the hash gone, but the entry was indexed again before the drop:
    the new row stays."""
    clock = Clock()
    idx = local(fr, clock)
    idx.put(hx(1), hx(1, 32), "old", unit(8, 1), 2000.0)
    idx.put(hx(2), hx(1, 32), "gone", unit(8, 2), 2000.0)
    real = fr.pipeline

    def pipeline(*args, **kwargs):
        pipe = real(*args, **kwargs)
        execute = pipe.execute

        def execute_then_store_again():
            res = execute()
            idx.put(hx(1), hx(1, 32), "new", unit(8, 1), 3000.0)  # indexed again
            return res

        pipe.execute = execute_then_store_again
        return pipe

    idx.r.pipeline = pipeline  # type: ignore[method-assign]
    assert idx.drop_gone([hx(1), hx(2)]) == 1
    assert [c.text for c in idx.search(hx(1, 32), unit(8, 1), 3)] == ["new"]
