"""Micro-batching: texts submitted by concurrent requests are embedded together.

``workers`` threads (default 1) share the queue; each takes the first waiting item, then
keeps collecting for at most ``max_wait_s`` (default 5 ms) or until ``max_batch`` items
(default 32) are in hand, and runs the encode function once on the whole batch. With
more than one worker the encode function must be thread-safe; a second worker lets a
batch start while the previous one still runs (numpy releases the GIL in its matrix
products), which is what a second core is for. Under load, items pile up
while the model runs, batches fill up and the per-text cost falls, so throughput grows
with concurrency. An optional ``expected()`` callback (items currently wanted by callers,
e.g. requests in flight) lets the worker stop waiting as soon as every expected item is
in the batch, so a lone request does not pay the wait. A caller that has a batch of its
own (``run``) encodes it in its own thread, holding one of ``own_workers`` slots (so at
most that many such calls run at once, beside the workers' batches); without
``own_workers`` (an encode function that is not thread-safe) it holds one of the
``workers`` slots the workers' batches hold too.

Pure logic: the encode function is injected (``list[T] -> sequence of results, same
length``), so the batcher is unit-tested without a model.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from controlplane.errors import InfergateError

T = TypeVar("T")
R = TypeVar("R")


class BatcherClosed(InfergateError, RuntimeError):
    """Submitted after :meth:`MicroBatcher.close`."""


@dataclass
class _Item(Generic[T, R]):
    value: T
    future: "Future[R]"


class MicroBatcher(Generic[T, R]):
    """Collects items into batches for ``encode``.

    ``submit(x)`` returns a :class:`concurrent.futures.Future` resolved with ``encode``'s
    result for ``x``, or with the exception ``encode`` raised for the batch (every item of
    that batch gets it). ``on_batch(n)`` is called with each batch size (metrics)."""

    def __init__(self, encode: Callable[[list[T]], Sequence[R]], max_batch: int = 32,
                 max_wait_s: float = 0.005, on_batch: Callable[[int], None] | None = None,
                 name: str = "embed-batcher", expected: Callable[[], int] | None = None,
                 workers: int = 1, own_workers: int | None = None):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if workers < 1 or (own_workers is not None and own_workers < 1):
            raise ValueError("workers and own_workers must be >= 1")
        if max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")
        self._encode = encode
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._on_batch = on_batch
        self._expected = expected
        self._q: queue.SimpleQueue[_Item[T, R] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        # submit's check-and-put and close's set-and-mark happen under it, so every item
        # is queued before the stop markers (FIFO: the workers take it before a marker)
        self._gate = threading.Lock()
        self._busy = 0  # items taken by workers and not yet resolved
        self._busy_lock = threading.Lock()
        # encode calls at once: the workers' batches (shared with run() unless
        # own_workers), and run()'s
        self._slots: threading.BoundedSemaphore | contextlib.nullcontext = (
            threading.BoundedSemaphore(workers) if own_workers is None
            else contextlib.nullcontext())
        self._own = (self._slots if own_workers is None
                     else threading.BoundedSemaphore(own_workers))
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()
        self._thread = self._threads[0]

    def submit(self, value: T) -> "Future[R]":
        """Queue one item; raises :class:`BatcherClosed` after :meth:`close`."""
        fut: Future[R] = Future()
        with self._gate:
            if self._closed.is_set():
                raise BatcherClosed("batcher is closed")
            self._q.put(_Item(value, fut))
        return fut

    def submit_many(self, values: Sequence[T]) -> list["Future[R]"]:
        return [self.submit(v) for v in values]

    def run(self, values: Sequence[T], timeout: float | None = None) -> list[R]:
        """``encode`` of ``values`` now, in the caller's thread, in batches of at most
        ``max_batch``, each holding one of the ``own_workers`` slots (else one of the
        ``workers`` slots; waiting at most ``timeout`` s for one: :class:`TimeoutError`).
        Raises what ``encode`` raises, or :class:`BatcherClosed` after :meth:`close`."""
        if self._closed.is_set():
            raise BatcherClosed("batcher is closed")
        out: list[R] = []
        for i in range(0, len(values), self.max_batch):
            if not self._own.acquire(timeout=timeout):  # type: ignore[union-attr]
                raise TimeoutError("no encode slot free in time")
            try:
                out.extend(self._call(list(values[i:i + self.max_batch])))
            finally:
                self._own.release()  # type: ignore[union-attr]
        return out

    def _call(self, values: list[T]) -> Sequence[R]:
        """``on_batch``, then ``encode`` of ``values`` with its answer's length checked."""
        if self._on_batch is not None:
            try:
                self._on_batch(len(values))
            except Exception:  # noqa: BLE001 - metrics must not break embedding
                pass
        results = self._encode(values)
        if len(results) != len(values):
            raise RuntimeError(f"encode returned {len(results)} results "
                               f"for {len(values)} items")
        return results

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the items already queued; waits up to ``timeout`` s for the workers.

        Every item submitted before ``close`` is encoded and answered (the workers take
        the queue in order, and each worker's own stop marker comes after every item);
        each worker then exits on its marker. A later :meth:`submit` raises
        :class:`BatcherClosed`. Returns when every worker has exited, or after
        ``timeout`` s when an encode call is still running."""
        with self._gate:
            first = not self._closed.is_set()
            self._closed.set()
            if first:
                for _ in self._threads:
                    self._q.put(None)  # one stop marker per worker
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _collect(self, first: _Item[T, R]) -> tuple[list[_Item[T, R]], bool]:
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        stop = False
        while len(batch) < self.max_batch:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self._expected is not None
                                      and self._expected() - self._busy <= len(batch)):
                    break  # out of time, or nobody else is about to submit
                try:
                    item = self._q.get(timeout=min(remaining, 0.001)
                                       if self._expected is not None else remaining)
                except queue.Empty:
                    continue
            if item is None:
                stop = True
                break
            batch.append(item)
        return batch, stop

    def _run(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            batch, stop = self._collect(first)
            live = [it for it in batch if it.future.set_running_or_notify_cancel()]
            if live:
                with self._busy_lock:
                    self._busy += len(live)
                try:
                    self._process(live)
                finally:
                    with self._busy_lock:
                        self._busy -= len(live)
            if stop:
                return  # its own stop marker: every item before it is taken already

    def _process(self, batch: list[_Item[T, R]]) -> None:
        try:
            with self._slots:
                results = self._call([it.value for it in batch])
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            for it in batch:
                it.future.set_exception(exc)
            return
        for it, res in zip(batch, results):
            it.future.set_result(res)
