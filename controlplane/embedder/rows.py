"""The rows of the in-process vector index (:class:`controlplane.embedder.index.LocalIndex`),
in memory: one matrix per namespace, bounded in rows and given back as rows go.

- A namespace's block starts with room for one row and doubles when full; it halves when
  a quarter or less of it is used, and a namespace left with no row is deleted.
- Every row has an expiry (epoch seconds, ``inf`` = none). A min-heap of ``(expires_at,
  key)`` finds the rows that expired in any namespace: :meth:`RowTable.sweep` drops at most
  ``budget`` of them per call, so no call scans every row. A heap item whose row was
  replaced or deleted since is skipped when met (and the heap is rebuilt when such items
  outnumber the rows).
- At most ``max_rows`` rows: a :meth:`RowTable.put` over it drops the rows that expire
  soonest (logged once per table, counted in :attr:`RowTable.dropped_over_cap`).

Pure data structure, no Redis and no lock: the caller serialises calls.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("infergate.embedder")

#: Rows kept at most by default, per index (one embedding model), per process.
DEFAULT_MAX_ROWS = 100_000
#: Stale heap items (rows replaced or deleted since) tolerated beyond the rows held.
HEAP_SLACK = 1024
#: Rows held at or above which a table whose row count fell to a quarter of its peak
#: copies its dicts (Python dicts never shrink on deletion alone).
COMPACT_MIN = 4096


@dataclass(slots=True)
class Block:
    """The rows of one namespace: ``mat[:n]`` (unit vectors), ``expires[:n]`` (epoch s),
    ``keys[i]``, ``texts[i]``."""

    dim: int
    keys: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    mat: np.ndarray = field(init=False)
    expires: np.ndarray = field(init=False)
    n: int = 0

    def __post_init__(self) -> None:
        self.mat = np.zeros((1, self.dim), dtype=np.float32)
        self.expires = np.zeros(1, dtype=np.float64)

    @property
    def capacity(self) -> int:
        return int(self.mat.shape[0])

    def _resize(self, cap: int) -> None:
        mat = np.zeros((cap, self.dim), dtype=np.float32)
        exp = np.zeros(cap, dtype=np.float64)
        mat[:self.n] = self.mat[:self.n]
        exp[:self.n] = self.expires[:self.n]
        self.mat, self.expires = mat, exp

    def append(self, key: str, text: str, vec: np.ndarray, expires_at: float) -> int:
        """Add a row (doubling the room when full); returns its position."""
        if self.n == self.capacity:
            self._resize(self.capacity * 2)
        row = self.n
        self.mat[row] = vec
        self.expires[row] = expires_at
        self.keys.append(key)
        self.texts.append(text)
        self.n += 1
        return row

    def remove(self, row: int) -> str | None:
        """Swap-remove ``row``; returns the key that moved into ``row`` (or None). Halves
        the room when a quarter or less of it is used."""
        last = self.n - 1
        moved = None
        if row != last:
            self.mat[row] = self.mat[last]
            self.expires[row] = self.expires[last]
            self.keys[row] = self.keys[last]
            self.texts[row] = self.texts[last]
            moved = self.keys[row]
        self.keys.pop()
        self.texts.pop()
        self.n -= 1
        if self.n and self.n * 4 <= self.capacity:
            self._resize(max(1, self.capacity // 2))
        return moved


class RowTable:
    """Namespace -> :class:`Block`, key -> (namespace, row), the expiry heap and the cap.

    ``max_rows`` (>= 1) rows at most. Not thread-safe."""

    def __init__(self, dim: int, max_rows: int = DEFAULT_MAX_ROWS):
        if max_rows < 1:
            raise ValueError("max_rows: at least 1")
        self.dim = dim
        self.max_rows = max_rows
        self.blocks: dict[str, Block] = {}
        self._where: dict[str, tuple[str, int]] = {}
        self._heap: list[tuple[float, str]] = []
        self._peak = 0
        #: Rows dropped because the table was full (their entries may still exist).
        self.dropped_over_cap = 0
        #: Rows dropped because they expired (:meth:`sweep`, :meth:`drop_expired_in`).
        self.dropped_expired = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        """Every key held (a copy)."""
        return list(self._where)

    def expires_of(self, key: str) -> float | None:
        """The expiry (epoch s) of ``key``'s row, or None when it has none."""
        loc = self._where.get(key)
        if loc is None:
            return None
        ns, row = loc
        return float(self.blocks[ns].expires[row])

    def put(self, key: str, namespace: str, text: str, vec: np.ndarray,
            expires_at: float) -> None:
        """Insert or replace one row (``expires_at`` epoch s, ``inf`` = never), then drop
        the rows that expire soonest while over ``max_rows``."""
        self.delete(key)
        block = self.blocks.get(namespace)
        if block is None:
            block = self.blocks[namespace] = Block(self.dim)
        row = block.append(key, text, vec, expires_at)
        self._where[key] = (namespace, row)
        self._peak = max(self._peak, len(self._where))
        heapq.heappush(self._heap, (expires_at, key))
        if len(self._where) > self.max_rows:
            self._over_cap()
        self._maybe_compact()

    def _over_cap(self) -> None:
        if not self.dropped_over_cap:
            log.warning("local vector index full (%d rows, cache.semantic_index_max_rows): "
                        "the rows expiring soonest leave it (their entries answer exact "
                        "hits only); logged once", self.max_rows)
        while len(self._where) > self.max_rows and self._heap:
            exp, key = heapq.heappop(self._heap)
            if self.expires_of(key) == exp:
                self.delete(key)
                self.dropped_over_cap += 1

    def delete(self, key: str) -> bool:
        """Remove ``key``'s row; a namespace left empty is deleted. False when absent."""
        loc = self._where.pop(key, None)
        if loc is None:
            return False
        ns, row = loc
        block = self.blocks[ns]
        moved = block.remove(row)
        if moved is not None:
            self._where[moved] = (ns, row)
        if block.n == 0:
            del self.blocks[ns]
        return True

    def sweep(self, now: float, budget: int) -> int:
        """Drop rows expired at ``now`` in any namespace, looking at most at ``budget`` heap
        items; returns how many it looked at (0 = nothing expired is left)."""
        done = 0
        heap = self._heap
        while done < budget and heap and heap[0][0] <= now:
            exp, key = heapq.heappop(heap)
            done += 1
            if self.expires_of(key) == exp:
                self.delete(key)
                self.dropped_expired += 1
        self._maybe_compact()
        return done

    def drop_expired_in(self, namespace: str, now: float) -> None:
        """Drop the expired rows of one namespace (before searching it)."""
        block = self.blocks.get(namespace)
        if block is None:
            return
        dead = np.nonzero(block.expires[:block.n] <= now)[0]
        for row in sorted(dead.tolist(), reverse=True):
            self.delete(block.keys[row])
            self.dropped_expired += 1

    def _maybe_compact(self) -> None:
        """Rebuild the heap when stale items outnumber the rows by :data:`HEAP_SLACK`;
        copy the dicts when the rows fell to a quarter of their peak."""
        n = len(self._where)
        if len(self._heap) > 2 * n + HEAP_SLACK:
            self._heap = [(float(self.blocks[ns].expires[row]), k)
                          for k, (ns, row) in self._where.items()]
            heapq.heapify(self._heap)
        if self._peak >= COMPACT_MIN and n * 4 <= self._peak:
            self._where = dict(self._where)
            self.blocks = dict(self.blocks)
            self._peak = n
