"""The sweep of the response cache's index sets: members whose entry is gone leave them.

The edge adds every stored entry to three sets, ``keynames.cache_index(dim, value)``
(tenant, model, namespace), and renews each set's TTL to that of its longest-lived entry
(``EXPIRE NX`` then ``GT``). Under steady traffic a set's TTL never runs out, so without
this sweep the members of expired or evicted entries would stay for ever (and under
``volatile-lru`` the sets would push live entries out).

:meth:`IndexSweeper.run_once` (a job of the leader control plane, every
:data:`SWEEP_INTERVAL_S`) walks the sets with ``SCAN`` over ``keynames.CACHE_INDEX_PREFIX``
and each set with ``SSCAN``, both cursors kept from one run to the next, and checks at
most :data:`SWEEP_MAX_MEMBERS` members per run (within :data:`SWEEP_BUDGET_S`): one
pipeline of ``EXISTS`` on their entries per :data:`SWEEP_BATCH` members, then ``SREM`` of
those without one. A member whose entry was stored again in between (the same request
answered again) is added back, with the set's TTL raised to cover that entry's. A run ends
when a walk over every set ends; the next run starts another.

Every key is used alone (no script, no transaction), so it runs the same on Redis Cluster
(redis-py's cluster ``SCAN`` walks every master; pipelines are split per node). There,
the edge's own pipeline may write a set before the entry's node, so a member removed in
the few milliseconds between may miss that entry's sets until it expires (a scoped purge
would not find it; ``purge --all`` and ``drop`` still do).

Once per sweeper (so once per control-plane process that leads), the ``sample`` field
earlier versions kept in the namespace hashes ``keynames.cache_ns_stats(ns)`` for 30 days
is deleted (the sample now has its own key with the entry's TTL,
``keynames.cache_ns_sample``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from controlplane.redisdb import keynames

#: Seconds between two runs of the sweep (leader control plane).
SWEEP_INTERVAL_S = 10.0
#: Members (and legacy namespace hashes) one run looks at, at most.
SWEEP_MAX_MEMBERS = 20_000
#: Seconds one run may take, at most (checked between batches).
SWEEP_BUDGET_S = 1.0
#: Members per ``SSCAN`` ``COUNT`` and per ``EXISTS`` pipeline.
SWEEP_BATCH = 500


@dataclass
class SweepReport:
    """What one run did."""

    checked: int = 0
    """Index set members whose entry was looked up."""
    removed: int = 0
    """Members removed (their entry was gone)."""
    restored: int = 0
    """Members added back: their entry was stored again while they were removed."""
    sets_done: int = 0
    """Index sets walked to their end in this run."""
    pass_done: bool = False
    """The walk over every index set ended in this run."""
    legacy_samples: int = 0
    """``sample`` fields deleted from namespace hashes (written by earlier versions)."""


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class IndexSweeper:
    """Removes the members of the index sets whose entry is gone, a bounded part per
    :meth:`run_once`. Keeps its cursors between runs; not thread-safe (one scheduled job
    calls it). ``r``: a ``redis.Redis`` or ``redis.RedisCluster`` (decoded or not)."""

    def __init__(self, r: redis.Redis, *, max_members: int = SWEEP_MAX_MEMBERS,
                 budget_s: float = SWEEP_BUDGET_S, batch: int = SWEEP_BATCH,
                 clock: Callable[[], float] = time.monotonic):
        self.r = r
        self.max_members = max_members
        self.budget_s = budget_s
        self.batch = batch
        self._clock = clock
        self._sets: Iterator | None = None
        self._set: str = ""
        self._members: Iterator | None = None
        self._legacy: Iterator | None = None
        self._legacy_done = False

    def reset(self) -> None:
        """Start the next run from the first set (after a Redis error)."""
        self._sets = self._members = self._legacy = None

    def run_once(self) -> SweepReport:
        """One run (see the module docstring). Raises ``redis.exceptions.RedisError``
        (the cursors start over at the next run)."""
        rep = SweepReport()
        deadline = self._clock() + self.budget_s
        try:
            work = self._legacy_samples(rep)
            while work < self.max_members and self._clock() < deadline:
                if self._members is None:
                    if self._sets is None:
                        self._sets = self.r.scan_iter(
                            match=keynames.CACHE_INDEX_PREFIX + "*", count=1000)
                    name = next(self._sets, None)
                    if name is None:
                        self._sets = None
                        rep.pass_done = True
                        break
                    self._set = _s(name)
                    self._members = self.r.sscan_iter(self._set, count=self.batch)
                chunk = [_s(m) for m in itertools.islice(self._members, self.batch)]
                if not chunk:
                    self._members = None
                    rep.sets_done += 1
                    continue
                work += len(chunk)
                rep.checked += len(chunk)
                self._remove_dead(self._set, chunk, rep)
        except redis.exceptions.RedisError:
            self.reset()
            raise
        return rep

    def _remove_dead(self, name: str, members: list[str], rep: SweepReport) -> None:
        """``SREM`` the members of set ``name`` whose entry is gone; add back those whose
        entry exists again right after (its TTL given to the set, ``PEXPIRE NX`` / ``GT``,
        as the edge does)."""
        pipe = self.r.pipeline(transaction=False)
        for m in members:
            pipe.exists(keynames.cache_entry(m))
        dead = [m for m, e in zip(members, pipe.execute()) if not e]
        if not dead:
            return
        rep.removed += int(self.r.srem(name, *dead))
        pipe = self.r.pipeline(transaction=False)
        for m in dead:
            pipe.pttl(keynames.cache_entry(m))
        back = [(m, int(t)) for m, t in zip(dead, pipe.execute()) if int(t) > 0]
        if back:
            ttl_ms = max(t for _, t in back)
            pipe = self.r.pipeline(transaction=False)
            pipe.sadd(name, *(m for m, _ in back))
            pipe.pexpire(name, ttl_ms, nx=True)
            pipe.pexpire(name, ttl_ms, gt=True)
            pipe.execute()
            rep.restored += len(back)

    def _legacy_samples(self, rep: SweepReport) -> int:
        """Until done once: ``HDEL sample`` on the namespace hashes, :data:`SWEEP_BATCH` at a
        time, at most :attr:`max_members` per run; returns how many hashes it looked at."""
        work = 0
        while not self._legacy_done and work < self.max_members:
            if self._legacy is None:
                self._legacy = self.r.scan_iter(match=keynames.CACHE_NS_STATS_PREFIX + "*",
                                                count=1000)
            names = [_s(n) for n in itertools.islice(self._legacy, self.batch)]
            if not names:
                self._legacy_done = True
                self._legacy = None
                break
            work += len(names)
            pipe = self.r.pipeline(transaction=False)
            for n in names:
                pipe.hdel(n, "sample")
            rep.legacy_samples += sum(int(x) for x in pipe.execute())
        return work
