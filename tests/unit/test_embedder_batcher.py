"""Micro-batcher: pure logic with an injected encode function."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from controlplane.embedder.batcher import BatcherClosed, MicroBatcher


class Recorder:
    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.batches: list[list[int]] = []
        self.gate = gate
        self.fail = fail
        self.lock = threading.Lock()

    def __call__(self, items: list[int]) -> list[int]:
        if self.gate is not None:
            self.gate.wait(5)
        with self.lock:
            self.batches.append(list(items))
        if self.fail:
            raise ValueError("model broke")
        return [x * 10 for x in items]


def test_single_item_is_answered() -> None:
    rec = Recorder()
    b = MicroBatcher(rec, max_batch=8, max_wait_s=0.001)
    try:
        assert b.submit(3).result(timeout=5) == 30
        assert rec.batches == [[3]]
    finally:
        b.close()


def test_waiting_items_are_batched_and_bounded() -> None:
    """While the worker is busy, submissions pile up; they go out in batches of at most
    max_batch, every item gets its own result, and order inside a batch is kept."""
    gate = threading.Event()
    rec = Recorder(gate)
    sizes: list[int] = []
    b = MicroBatcher(rec, max_batch=4, max_wait_s=0.05, on_batch=sizes.append)
    try:
        first = b.submit(0)           # the worker takes it and blocks on the gate
        futs = b.submit_many(list(range(1, 11)))
        gate.set()
        assert first.result(timeout=5) == 0
        assert [f.result(timeout=5) for f in futs] == [x * 10 for x in range(1, 11)]
        assert all(len(batch) <= 4 for batch in rec.batches)
        assert sorted(x for batch in rec.batches for x in batch) == list(range(11))
        assert max(len(batch) for batch in rec.batches) == 4
        assert sizes == [len(batch) for batch in rec.batches]
    finally:
        b.close()


def test_concurrent_submitters_share_batches() -> None:
    rec = Recorder()
    b = MicroBatcher(rec, max_batch=32, max_wait_s=0.02)
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda x: b.submit(x).result(timeout=5), range(64)))
        assert results == [x * 10 for x in range(64)]
        assert len(rec.batches) < 64  # at least some requests were embedded together
    finally:
        b.close()


def test_encode_error_reaches_every_waiter_and_worker_survives() -> None:
    rec = Recorder(fail=True)
    b = MicroBatcher(rec, max_batch=4, max_wait_s=0.001)
    try:
        with pytest.raises(ValueError, match="model broke"):
            b.submit(1).result(timeout=5)
        rec.fail = False
        assert b.submit(2).result(timeout=5) == 20
    finally:
        b.close()


def test_wrong_result_count_is_an_error() -> None:
    b = MicroBatcher(lambda items: [1], max_batch=4, max_wait_s=0.05)
    try:
        futs = b.submit_many([1, 2])
        errors = [f.exception(timeout=5) for f in futs]
        assert any(isinstance(e, RuntimeError) for e in errors)
    finally:
        b.close()


def test_close_finishes_queued_work_then_refuses() -> None:
    gate = threading.Event()
    rec = Recorder(gate)
    b = MicroBatcher(rec, max_batch=2, max_wait_s=0.0)
    futs = b.submit_many([1, 2, 3, 4, 5])
    gate.set()
    b.close()
    assert [f.result(timeout=5) for f in futs] == [10, 20, 30, 40, 50]
    with pytest.raises(BatcherClosed):
        b.submit(6)


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        MicroBatcher(lambda x: x, max_batch=0)
    with pytest.raises(ValueError):
        MicroBatcher(lambda x: x, max_wait_s=-1)


def test_lone_item_does_not_wait_when_nobody_else_is_expected() -> None:
    """With expected() == items in hand, the worker does not sit out max_wait_s (60 s)."""
    rec = Recorder()
    b = MicroBatcher(rec, max_batch=8, max_wait_s=60.0, expected=lambda: 1)
    try:
        assert b.submit(4).result(timeout=10) == 40
    finally:
        b.close()


def test_waits_for_expected_items() -> None:
    """expected() says two items are coming: the worker holds the first until the second
    arrives (well within max_wait_s) and embeds both together."""
    rec = Recorder()
    b = MicroBatcher(rec, max_batch=8, max_wait_s=30.0, expected=lambda: 2)
    try:
        first = b.submit(1)
        assert not first.done()
        second = b.submit(2)
        assert (first.result(timeout=10), second.result(timeout=10)) == (10, 20)
        assert rec.batches == [[1, 2]]
    finally:
        b.close()
