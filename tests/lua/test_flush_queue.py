"""The per-worker flush queue (lua/infergate/core/flush.lua), run inside nginx with a
stand-in for infergate.redis.pool: writes go out in one pipeline with the counters
after them, callbacks get their own replies, a full queue drops (and counts) instead of
queueing, counters survive a failed flush, large queues are cut into batches."""

from __future__ import annotations

from support.stack import lua_eval

PRELUDE = """
    local sent, fail = {}, false
    package.loaded["infergate.redis.pool"] = {
        run = function(fn)
            if fail then
                return nil, "redis connect: refused"
            end
            return fn({ pipeline = function(_, cmds)
                sent[#sent + 1] = cmds
                local out = {}
                for i, c in ipairs(cmds) do
                    out[i] = c[1] == "BAD" and { false, "ERR bad" } or ("r" .. i)
                end
                return out
            end })
        end,
    }
    local dropped = {}
    package.loaded["infergate.core.prometheus"] = {
        flush_dropped = function(kind) dropped[#dropped + 1] = kind end,
    }
    local flush = require("infergate.core.flush")
    flush.use(package.loaded["infergate.redis.pool"])
"""


def run(workdir, code: str):
    return lua_eval(workdir, PRELUDE + code)


def test_one_pipeline_counters_last_and_replies_per_write(workdir) -> None:
    out = run(workdir, """
        local got = {}
        flush.count("stats", "misses", 1, 60)
        flush.push("cache_store", { { "SET", "a", "1" }, { "SADD", "s", "a" } },
                   function(replies, err) got.a = { replies = replies, err = err } end)
        flush.count("stats", "misses", 2, 60)
        flush.push("cache_store", { { "BAD" } },
                   function(replies, err) got.b = { replies = replies, err = err } end)
        local n = flush.run_once()
        local q, c = flush.pending()
        return { n = n, sent = sent, got = got, queued = q, counters = c }
    """)
    assert out["n"] == 2 and out["queued"] == 0 and out["counters"] == 0
    assert len(out["sent"]) == 1  # one round trip
    cmds = out["sent"][0]
    assert [c[0] for c in cmds] == ["SET", "SADD", "BAD", "HINCRBY", "EXPIRE"]
    assert cmds[3] == ["HINCRBY", "stats", "misses", 3]  # summed
    assert out["got"]["a"]["replies"] == ["r1", "r2"]
    assert out["got"]["b"]["replies"] == [[False, "ERR bad"]]


def test_full_queue_drops_counts_and_calls_back(workdir) -> None:
    out = run(workdir, """
        package.loaded["infergate.core.config"].get_or_empty = function()
            return { edge = { flush_queue_max = 2 } }
        end
        local calls = {}
        local ok = {}
        for i = 1, 5 do
            ok[i] = flush.push("cache_store", { { "SET", "k" .. i, "v" } }, function(r, err)
                calls[#calls + 1] = err or "ok"
            end)
        end
        local before = #calls
        flush.run_once()
        return { ok = ok, before = before, calls = calls, dropped = dropped, stats = flush.stats(),
                 sent = #sent[1] }
    """)
    assert out["ok"] == [True, True, False, False, False]
    assert out["before"] == 3 and out["calls"][:3] == ["queue full"] * 3
    assert out["calls"][3:] == ["ok", "ok"]
    assert out["dropped"] == ["cache_store"] * 3
    assert out["stats"]["dropped"] == 3 and out["sent"] == 2


def test_counters_are_kept_when_redis_fails(workdir) -> None:
    out = run(workdir, """
        local errs = {}
        fail = true
        flush.count("stats", "hits_exact", 4, 60)
        flush.push("ratelimit_correction", { { "EVALSHA", "x" } }, function(r, err)
            errs[#errs + 1] = err
            -- a callback may queue again (it runs in the timer)
        end)
        flush.run_once()
        local _, kept = flush.pending()
        fail = false
        flush.run_once()
        return { errs = errs, kept = kept, sent = sent }
    """)
    assert out["errs"] == ["redis connect: refused"]
    assert out["kept"] == 1
    assert out["sent"] == [[["HINCRBY", "stats", "hits_exact", 4], ["EXPIRE", "stats", 60]]]


def test_large_queues_go_out_in_batches(workdir) -> None:
    out = run(workdir, """
        flush.MAX_BATCH = 10
        local seen = 0
        for i = 1, 25 do
            flush.push("cache_store", { { "SET", "k" .. i, "v" } }, function(r)
                if r and r[1] then seen = seen + 1 end
            end)
        end
        flush.count("stats", "lookups", 25, 60)
        flush.run_once()
        local sizes = {}
        for i, p in ipairs(sent) do sizes[i] = #p end
        return { sizes = sizes, seen = seen, last = sent[#sent][#sent[#sent]][1] }
    """)
    assert out["seen"] == 25
    assert sum(out["sizes"]) == 25 + 2 and len(out["sizes"]) == 3
    assert out["last"] == "EXPIRE"  # the counters go with the last batch
