"""Consumer of the index queue (``keynames.cache_index_queues()``).

The edge cannot call HTTP from its timers, so after writing a cache entry it RPUSHes a
job (JSON, see ``wire.index_item``) to one shard of the queue (a tenant's own shard with
API keys, see ``keynames.cache_index_queue_shard``). One thread here waits with ``BLPOP``
on every shard (1 s timeout, so it stops promptly; the shard it starts from turns with
each batch), then takes up to ``(batch - 1) / shards`` more jobs from each shard in one
pipeline (``LPOP key count``), embeds them in one batch and stores the vectors: a
tenant that floods its shard gets one share of each batch, and the jobs of the others
are not queued behind its backlog. Malformed
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


#: Rounds of ``LPOP`` that fill a batch after its first job (see ``QueueConsumer._take``).
FILL_PASSES = 3

#: Longest wait (s) for running lookups to end before a batch is embedded anyway.
DEFER_MAX_S = 1.0


class QueueConsumer:
    """Background thread feeding ``engine.index_items`` from the index queue.

    ``r`` must have a socket timeout longer than the BLPOP timeout (1 s)."""

    def __init__(self, engine: Engine, r: redis.Redis, batch: int = 32,
                 queue_keys: list[str] | None = None, block_s: int = 1):
        self.engine = engine
        self.r = r
        self.batch = batch
        self.queue_keys = list(queue_keys or keynames.cache_index_queues())
        self.block_s = block_s
        self._turn = 0
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
        """The next batch: one job from a ``BLPOP`` on every shard (the first shard in
        the turn's order that has one), then an equal share of the rest of the batch
        from each shard (at least 1), the same turn's order; room a short shard left goes
        to the shards that still have jobs, in further passes (:data:`FILL_PASSES` in
        all), so a lone busy shard still fills whole batches. A batch may pass
        ``batch`` by less than the number of shards (a share is at least 1). ``[]``
        after ``block_s`` with none."""
        n = len(self.queue_keys)
        t, self._turn = self._turn, (self._turn + 1) % n
        keys = self.queue_keys[t:] + self.queue_keys[:t]
        got = self.r.blpop(keys, timeout=self.block_s)
        if not got:
            return []
        raws = [got[1]]
        for _ in range(FILL_PASSES):
            room = self.batch - len(raws)
            if room <= 0 or not keys:
                break
            share = max(1, room // len(keys))
            pipe = self.r.pipeline(transaction=False)
            for key in keys:
                pipe.lpop(key, share)
            more_keys = []
            for key, more in zip(keys, pipe.execute()):
                more = more or []
                raws.extend(more)
                if len(more) == share:
                    more_keys.append(key)   # it may hold more
            keys = more_keys
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
