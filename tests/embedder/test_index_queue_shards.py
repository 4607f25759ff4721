"""The semantic-index queue's shards: the edge pushes a job to its tenant's shard when
tenants are told apart by API keys (else to its entry's), and the embedder's consumer
takes from every shard in turn, so one tenant's backlog does not hold the others' jobs
back (real Redis; the edge's choice of shard in nginx's Lua)."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval

from controlplane.embedder.consumer import QueueConsumer
from controlplane.redisdb import keynames


def _job(tenant: str, i: int) -> str:
    return json.dumps({"key": f"{i:064x}", "namespace": "ns", "text": f"q{i}", "model": "m",
                       "tenant": tenant, "ttl_s": 60})


def test_a_flooded_shard_gets_one_share_of_each_batch(redis_server) -> None:
    r = redis_server.client()
    flood, quiet = keynames.cache_index_queue_shard(2), keynames.cache_index_queue_shard(5)
    r.rpush(flood, *[_job("big", i) for i in range(500)])      # queued first
    r.rpush(quiet, *[_job("small", i) for i in range(3)])
    r.rpush(keynames.CACHE_INDEX_QUEUE, _job("old-edge", 0))   # an older edge's job
    consumer = QueueConsumer(engine=None, r=r, batch=32)       # type: ignore[arg-type]
    first = [json.loads(x)["tenant"] for x in consumer._take()]
    # the quiet tenant's three jobs and the old edge's come in the first batch, not
    # after the flood's 500; the flood fills the rest of the batch
    assert first.count("small") == 3 and first.count("old-edge") == 1, first
    assert len(first) == 32, first
    taken = len(first)
    while True:
        batch = consumer._take()
        if not batch:
            break
        taken += len(batch)
        assert len(batch) <= 32 + len(keynames.cache_index_queues())
    assert taken == 504
    assert sum(r.llen(q) for q in keynames.cache_index_queues()) == 0


def test_a_lone_busy_shard_still_fills_whole_batches(redis_server) -> None:
    r = redis_server.client()
    r.rpush(keynames.cache_index_queue_shard(6), *[_job("only", i) for i in range(100)])
    consumer = QueueConsumer(engine=None, r=r, batch=32)       # type: ignore[arg-type]
    sizes = [len(consumer._take()) for _ in range(3)]
    assert sizes == [32, 32, 32], sizes


def test_the_edge_picks_the_tenants_shard_with_keys_and_the_entrys_without(
        workdir: Path) -> None:
    got = lua_eval(workdir, """
            local capture = require("infergate.cache.capture")
            local out = {keyed = {}, unkeyed = {}}
            for i = 1, 64 do
                local key = string.format("%064x", i)
                out.keyed[capture.index_queue("acme", key, true)] = true
                out.unkeyed[capture.index_queue("default", key, false)] = true
            end
            local n = function(t) local c = 0 for _ in pairs(t) do c = c + 1 end return c end
            return {keyed = n(out.keyed), unkeyed = n(out.unkeyed),
                    acme = capture.index_queue("acme", "x", true)}
    """)
    assert got["keyed"] == 1                 # one tenant: one shard, whatever the entry
    assert got["unkeyed"] >= 6               # spread over the 8 shards by entry
    assert got["acme"] in keynames.cache_index_queues()
