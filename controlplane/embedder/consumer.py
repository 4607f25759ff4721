"""Consumer of the index queue ``keynames.CACHE_INDEX_QUEUE``.

The edge cannot call HTTP from its timers, so after writing a cache entry it RPUSHes a
job (JSON, see ``wire.index_item``) to that list. One thread here waits with ``BLPOP``
(1 s timeout, so it stops promptly), then takes up to ``batch - 1`` more jobs already
waiting (``LPOP key count``), embeds them in one batch and stores the vectors. Malformed
jobs are logged and counted (``infergate_embedder_invalid_jobs_total``) and dropped.
While Redis is unreachable the thread retries with backoff (0.2 s doubling to 5 s); jobs
popped just before an outage may be lost (the cache entry then simply has no vector).

Before it embeds a batch it waits while lookups run in any process of the embedder
(``engine.activity``, see ``activity.py``), :data:`DEFER_MAX_S` at most: lookups are on
requests' paths within a time budget, indexing is not.
"""

from __future__ import annotations

import json
import logging
import threading

import redis

from controlplane.redisdb import keynames
from controlplane.embedder.engine import Engine, EngineUnavailable
from controlplane.embedder.wire import BadRequest, index_item

log = logging.getLogger("infergate.embedder")


#: Longest wait (s) for running lookups to end before a batch is embedded anyway.
DEFER_MAX_S = 1.0


class QueueConsumer:
    """Background thread feeding ``engine.index_items`` from the index queue.

    ``r`` must have a socket timeout longer than the BLPOP timeout (1 s)."""

    def __init__(self, engine: Engine, r: redis.Redis, batch: int = 32,
                 queue_key: str = keynames.CACHE_INDEX_QUEUE, block_s: int = 1):
        self.engine = engine
        self.r = r
        self.batch = batch
        self.queue_key = queue_key
        self.block_s = block_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-queue", daemon=True)
        self.processed = 0

    def start(self) -> "QueueConsumer":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _take(self) -> list[bytes]:
        got = self.r.blpop([self.queue_key], timeout=self.block_s)
        if not got:
            return []
        raws = [got[1]]
        if self.batch > 1:
            more = self.r.lpop(self.queue_key, self.batch - 1)
            if more:
                raws.extend(more)
        return raws

    def _parse(self, raws: list[bytes]):
        items = []
        for raw in raws:
            try:
                items.append(index_item(json.loads(raw)))
            except (ValueError, BadRequest) as exc:
                self.engine.metrics.invalid_jobs.inc()
                log.warning("index queue: dropped malformed job (%s): %.200r", exc, raw)
        return items

    def _defer(self) -> None:
        """Wait while lookups run (at most :data:`DEFER_MAX_S`), counted in the metrics."""
        activity = self.engine.activity
        if activity.busy():
            m = self.engine.metrics
            m.index_deferrals.inc()
            m.index_deferred_seconds.inc(activity.wait_idle(DEFER_MAX_S, self._stop))

    def _run(self) -> None:
        backoff, down = 0.2, False
        while not self._stop.is_set():
            try:
                raws = self._take()
                if down:
                    log.info("index queue: Redis reachable again")
                    down, backoff = False, 0.2
                if not raws:
                    continue
                items = self._parse(raws)
                if items:
                    self._defer()
                    self.engine.index_items(items, source="queue")
                self.processed += len(raws)
            except redis.exceptions.RedisError as exc:
                if not down:
                    log.warning("index queue: Redis error: %s; retrying", exc)
                down = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except EngineUnavailable as exc:
                log.warning("index queue: embedding failed, jobs dropped: %s", exc)
                self._stop.wait(0.5)
            except Exception:  # noqa: BLE001 - the thread must survive any bad job
                log.exception("index queue: unexpected error")
                self._stop.wait(0.5)
