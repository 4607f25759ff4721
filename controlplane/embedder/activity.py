"""Lookups in progress, as every process of one embedder sees them.

A lookup is on a request's path within the edge's time budget (150 ms by default);
indexing a stored answer is not. When a burst of lookups arrives, the answers of the ones
that missed are stored and queued for indexing at the same moment, and embedding them
took a third of the embedder's CPU in the burst benchmark, pushing lookups past their
budget. So the index-queue consumer (``consumer.py``) waits while lookups are running in
any process of the embedder, for at most a bound, then indexes anyway (under steady
lookup traffic indexing is delayed, never stopped).

The count lives in shared memory made before the processes fork
(``multiprocessing.RawArray``, one slot per process): each process writes only its own
slot, under a thread lock of its own, so no lock is shared between processes and a
process killed in the middle of an update cannot block the others. The supervisor resets
the slot of a process that died before its replacement takes it
(``cli/embedder_procs.py``).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class LookupActivity:
    """Lookup calls running in the processes of one embedder (``slots`` of them)."""

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self._shared = multiprocessing.RawArray("i", slots)
        self._slot = 0
        self._running = 0
        self._lock = threading.Lock()

    @property
    def slots(self) -> int:
        return len(self._shared)

    def bind(self, slot: int) -> None:
        """In a process: count its lookups in ``slot`` (0 .. slots - 1), from 0."""
        if not 0 <= slot < len(self._shared):
            raise ValueError(f"slot {slot} out of 0..{len(self._shared) - 1}")
        with self._lock:
            self._slot = slot
            self._running = 0
            self._shared[slot] = 0

    def reset(self, slot: int) -> None:
        """In the supervisor: zero the slot of a process that died."""
        self._shared[slot] = 0

    @contextmanager
    def lookup(self) -> Iterator[None]:
        """Counts the enclosed lookup call as running."""
        with self._lock:
            self._running += 1
            self._shared[self._slot] = self._running
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._shared[self._slot] = self._running

    def busy(self) -> bool:
        """True while a lookup call runs in any process."""
        return any(self._shared)

    def wait_idle(self, max_s: float, stop: threading.Event | None = None,
                  poll_s: float = 0.005) -> float:
        """Wait until no lookup runs, ``max_s`` seconds at most (or until ``stop`` is
        set); returns the seconds waited."""
        start = time.monotonic()
        while self.busy():
            left = max_s - (time.monotonic() - start)
            if left <= 0:
                break
            if stop is not None:
                if stop.wait(min(poll_s, left)):
                    break
            else:
                time.sleep(min(poll_s, left))
        return time.monotonic() - start
