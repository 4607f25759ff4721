"""MicroBatcher with several workers: batches run at once, every item is answered once,
close() stops all workers (the encode function is a fake, no model)."""

from __future__ import annotations

import threading
import time

import pytest

from controlplane.embedder.batcher import MicroBatcher


def test_two_workers_run_batches_at_the_same_time() -> None:
    running, peak = [0], [0]
    lock = threading.Lock()

    def encode(xs: list[int]) -> list[int]:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return [x * 2 for x in xs]

    b = MicroBatcher(encode, max_batch=4, max_wait_s=0.0, workers=2)
    try:
        futs = [b.submit(i) for i in range(16)]
        assert [f.result(timeout=5) for f in futs] == [2 * i for i in range(16)]
        assert peak[0] == 2
    finally:
        b.close()
    assert not any(t.is_alive() for t in b._threads)


def test_one_worker_never_overlaps() -> None:
    running, peak = [0], [0]

    def encode(xs: list[int]) -> list[int]:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        running[0] -= 1
        return xs

    b = MicroBatcher(encode, max_batch=2, max_wait_s=0.0)
    try:
        assert [f.result(timeout=5) for f in [b.submit(i) for i in range(8)]] == list(range(8))
        assert peak[0] == 1
    finally:
        b.close()


def test_items_queued_before_close_are_answered_by_some_worker() -> None:
    gate = threading.Event()

    def encode(xs: list[int]) -> list[int]:
        gate.wait(5)
        return xs

    b = MicroBatcher(encode, max_batch=2, max_wait_s=0.0, workers=3)
    futs = [b.submit(i) for i in range(9)]
    gate.set()
    b.close()
    assert sorted(f.result(timeout=5) for f in futs) == list(range(9))


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError):
        MicroBatcher(lambda xs: xs, workers=0)


def _tracking_encode(delay: float):
    running, peak, sizes = [0], [0], []
    lock = threading.Lock()

    def encode(xs: list[int]) -> list[int]:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            sizes.append(len(xs))
        time.sleep(delay)
        with lock:
            running[0] -= 1
        return [x * 10 for x in xs]

    return encode, peak, sizes


def test_run_encodes_in_the_callers_thread_in_max_batch_parts() -> None:
    encode, _, sizes = _tracking_encode(0.0)
    b = MicroBatcher(encode, max_batch=4, max_wait_s=0.0, own_workers=2)
    try:
        assert b.run(list(range(10))) == [x * 10 for x in range(10)]
        assert sizes == [4, 4, 2]
    finally:
        b.close()
    with pytest.raises(Exception, match="closed"):
        b.run([1])


def test_own_batches_run_up_to_own_workers_at_once_beside_the_workers() -> None:
    encode, peak, _ = _tracking_encode(0.05)
    b = MicroBatcher(encode, max_batch=4, max_wait_s=0.0, workers=1, own_workers=2)
    try:
        threads = [threading.Thread(target=b.run, args=([i],)) for i in range(4)]
        for t in threads:
            t.start()
        futs = [b.submit(i) for i in range(4)]
        for t in threads:
            t.join(5)
        assert [f.result(timeout=5) for f in futs] == [0, 10, 20, 30]
        assert peak[0] == 3   # two own batches and the worker's
    finally:
        b.close()


def test_without_own_workers_own_batches_share_the_workers_slot() -> None:
    """An encode function that is not thread-safe: run() and the worker never overlap."""
    encode, peak, _ = _tracking_encode(0.02)
    b = MicroBatcher(encode, max_batch=4, max_wait_s=0.0, workers=1)
    try:
        threads = [threading.Thread(target=b.run, args=([i],)) for i in range(3)]
        for t in threads:
            t.start()
        futs = [b.submit(i) for i in range(4)]
        for t in threads:
            t.join(5)
        assert sorted(f.result(timeout=5) for f in futs) == [0, 10, 20, 30]
        assert peak[0] == 1
    finally:
        b.close()
    with pytest.raises(ValueError):
        MicroBatcher(lambda xs: xs, own_workers=0)


def test_close_with_items_queued_stops_every_worker_promptly() -> None:
    """Three workers, items still queued when close() is called: every queued item is
    answered, and each worker exits on its own stop marker (none waits for the timeout)."""
    gate = threading.Event()
    started = threading.Semaphore(0)

    def encode(xs: list[int]) -> list[int]:
        started.release()
        assert gate.wait(5)
        return [x + 100 for x in xs]

    b = MicroBatcher(encode, max_batch=2, max_wait_s=0.0, workers=3)
    # an odd number queued: one worker's last batch meets a stop marker before it is full
    futs = [b.submit(i) for i in range(9)]
    for _ in range(3):  # every worker holds a batch; the other items wait in the queue
        assert started.acquire(timeout=5)
    assert not b._q.empty()
    took: list[float] = []

    def closer() -> None:
        t0 = time.monotonic()
        b.close(timeout=5.0)
        took.append(time.monotonic() - t0)

    c = threading.Thread(target=closer)
    c.start()
    gate.set()
    c.join(10)
    assert not c.is_alive() and took
    assert [t.is_alive() for t in b._threads] == [False, False, False]
    assert took[0] < 2.0  # hang guard: the timeout is 5 s
    assert sorted(f.result(timeout=1) for f in futs) == [i + 100 for i in range(9)]
    with pytest.raises(Exception, match="closed"):
        b.submit(1)
