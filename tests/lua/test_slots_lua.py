"""Known slots as a hard limit (infergate.admission.slots), the edge's FIFO queue
(infergate.admission.queue), the learned tail of answer times
(infergate.routing.learned) and the guard rails of the learned concurrency
(infergate.routing.speed); run in nginx's init_by_lua with real shared dicts
(support.stack.lua_eval)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.stack import lua_eval, lua_slot_prelude

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def run(workdir: Path, body: str):
    prelude = lua_slot_prelude({
        "speed": "infergate.routing.speed", "learned": "infergate.routing.learned",
        "slots": "infergate.admission.slots", "queue": "infergate.admission.queue",
        "held": "infergate.routing.held"}, score=0.1) + """
            local function answered(name, k, lat)
                speed.observe({node = name, k = k}, lat * 1000)
            end
"""
    return lua_eval(workdir, prelude + body, http_extra=DICTS)


def test_reserve_never_passes_a_nodes_known_slots(workdir: Path) -> None:
    got = run(workdir, """
            local t = tbl({node("a", {slots = 2}), node("b", {slots = 1})})
            t.by_name = {a = t.nodes[1], b = t.nodes[2]}
            local out = {taken = {}, refused = 0}
            for _ = 1, 6 do
                local req = {tried = {}}
                if slots.reserve(req, t, ngx.now()) then
                    out.taken[req.picked.name] = (out.taken[req.picked.name] or 0) + 1
                else
                    out.refused = out.refused + 1
                end
            end
            out.inflight = {a = stats.inflight("a"), b = stats.inflight("b")}
            out.free = slots.free(t, ngx.now())
            -- a held slot the balancer never used is given back in the log phase
            local req = {picked = {name = "a", claimed = true}}
            held.give_back(req)
            held.give_back(req)                     -- once only
            out.after_give_back = stats.inflight("a")
            out.free_after = slots.free(t, ngx.now())
            out.claim_over = stats.claim("b", 1)    -- b is full: the increment decides
            out.b = stats.inflight("b")
            return out
    """)
    assert got["taken"] == {"a": 2, "b": 1}
    assert got["refused"] == 3
    assert got["inflight"] == {"a": 2, "b": 1}
    assert got["free"] == 0
    assert got["after_give_back"] == 1 and got["free_after"] == 1
    assert got["claim_over"] is False and got["b"] == 1


def test_a_pool_without_known_slots_keeps_the_old_rule(workdir: Path) -> None:
    got = run(workdir, """
            local t = tbl({node("a"), node("b")})
            local mixed = tbl({node("a"), node("c", {slots = 1})})
            return {plain = slots.applies(t, ngx.now()),
                    mixed = slots.applies(mixed, ngx.now())}
    """)
    assert got == {"plain": False, "mixed": True}


def test_queue_is_first_come_first_served_and_survives_a_lost_ticket(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local now = ngx.now()
            out.empty = queue.empty("m")
            local t1 = queue.join("m", 0.02)
            local t2 = queue.join("m", 0.02)
            local t3 = queue.join("m", 0.02)
            out.ahead = {queue.ahead("m", t1, now), queue.ahead("m", t2, now),
                         queue.ahead("m", t3, now)}
            out.other = queue.empty("other")      -- per pool
            queue.leave("m", t2, now)             -- leaves from the middle: head stays
            out.after_middle = {queue.ahead("m", t1, now), queue.ahead("m", t3, now)}
            queue.leave("m", t1, now)             -- the head leaves: t2 is passed over too
            out.after_head = queue.ahead("m", t3, now)
            -- a ticket whose worker died: no alive key; passed over after the grace
            local t4 = queue.join("m", 0.02)
            local t5 = queue.join("m", 0.02)
            queue.leave("m", t3, now)
            ngx.shared.infergate_stats:delete("q:m:a" .. t4)
            out.lost_first = queue.ahead("m", t5, now)
            out.lost_later = queue.ahead("m", t5, now + queue.ALIVE_GRACE_S)
            queue.leave("m", t5, now)
            out.length = queue.length("m")
            out.empty_again = queue.empty("m")
            return out
    """)
    assert got["empty"] is True and got["other"] is True
    assert got["ahead"] == [0, 1, 2]
    assert got["after_middle"] == [0, 1]          # t2 left: not ahead of t3
    assert got["after_head"] == 0
    assert got["lost_first"] == 1 and got["lost_later"] == 0
    assert got["length"] == 0 and got["empty_again"] is True


def test_queue_length_counts_only_the_tickets_still_waiting(workdir: Path) -> None:
    """Tickets that left behind a waiting head (shed, admitted out of order) are not
    waiting: a churning flow is never taken for a full one."""
    got = run(workdir, """
            local now = ngx.now()
            local head = queue.join("m", 0.02)
            local out = {}
            for _ = 1, 50 do
                local t = queue.join("m", 0.02)
                queue.leave("m", t, now)
            end
            out.churned = queue.length("m")
            local t = queue.join("m", 0.02)
            out.two = queue.length("m")
            queue.leave("m", t, now)
            queue.leave("m", t, now)               -- twice: counted once
            out.one = queue.length("m")
            ngx.shared.infergate_stats:delete("q:m:a" .. head)   -- its worker died
            queue.ahead("m", head, now)
            queue.ahead("m", head, now + queue.ALIVE_GRACE_S)
            out.lost = queue.length("m")
            out.empty = queue.empty("m")
            return out
    """)
    assert got == {"churned": 1, "two": 2, "one": 1, "lost": 0, "empty": True}


def test_a_queue_whose_marks_were_evicted_catches_up_after_one_grace(workdir: Path) -> None:
    """A flood that filled the shared dict may evict the marks of thousands of tickets
    that left: the head passes such a run after one ALIVE_GRACE_S, not one grace per
    ticket, the waiting count never goes below 0, and passed tickets leave no marks."""
    got = run(workdir, """
            local d = ngx.shared.infergate_stats
            local now = ngx.now()
            local first = queue.join("m", 0.02)   -- holds the head while the others leave
            local gone = {}
            for i = 1, 1000 do
                gone[i] = queue.join("m", 0.02)
            end
            local waiter = queue.join("m", 0.02)
            for i = 1, 1000 do           -- left behind the head, then their marks evicted
                queue.leave("m", gone[i], now)
                d:delete("q:m:a" .. gone[i]); d:delete("q:m:d" .. gone[i])
            end
            queue.leave("m", first, now)
            -- the tickets that left are not ahead of it, though the head has not passed them
            local out = {before = queue.ahead("m", waiter, now), head = d:get("qh:m")}
            -- after one grace, each look passes up to 64 tickets: 1000 in 16 looks, all at
            -- the same time (not one grace per run of 64)
            local looks = 0
            local t = now + queue.ALIVE_GRACE_S
            queue.ahead("m", waiter, t)
            while d:get("qh:m") < waiter and looks < 100 do
                queue.ahead("m", waiter, t)
                looks = looks + 1
                t = t + 0.001
            end
            out.looks = looks
            out.ahead = queue.ahead("m", waiter, t)
            out.length = queue.length("m")
            local left = 0
            for i = 1, 1000 do
                for _, m in ipairs({"d", "m", "l"}) do
                    if d:get("q:m:" .. m .. gone[i]) ~= nil then left = left + 1 end
                end
            end
            out.marks_left = left
            queue.leave("m", waiter, t)
            out.count = d:get("qc:m")
            -- a ticket that leaves again after the head passed it is not uncounted twice
            local x = queue.join("m", 0.02)
            local y = queue.join("m", 0.02)
            queue.leave("m", x, t)
            queue.leave("m", x, t)
            out.count_twice = d:get("qc:m")
            return out
    """)
    assert got["before"] == 0 and got["head"] < 1000
    assert got["ahead"] == 0 and got["looks"] <= 20
    assert got["length"] == 1 and got["marks_left"] == 0
    assert got["count"] == 0 and got["count_twice"] == 1      # y still waits


def test_tail_prediction_has_a_prior_bounds_decay_and_the_max_tokens_cap(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local now = ngx.now()
            out.prior = learned.tail_s("a", 1.0, nil, now)          -- nothing learned: 2 x mean
            for i = 1, 400 do learned.observe("a", (i % 10 == 0) and 5.0 or 1.0, 100, now) end
            out.learned = learned.tail_s("a", 1.4, nil, now)
            out.excess = learned.info("a").e
            out.floor = learned.tail_s("a", 9.0, nil, now)          -- never below the mean
            for _ = 1, 200 do learned.observe("b", 1.0, nil, now) end
            out.floor_excess = learned.info("b").e                  -- no spread: the mean
            for _ = 1, 200 do learned.observe_cut("b", 1000, now) end
            out.ceiling = learned.tail_s("b", 0.1, nil, now)        -- at most 8 x the mean
            out.decayed = learned.tail_s("a", 1.4, nil, now + 60 + learned.HALF_LIFE_S * 20)
            out.pt = learned.info("a").pt
            out.capped = learned.tail_s("a", 1.4, {body = {max_tokens = 50}}, now)
            out.capped2 = learned.tail_s("a", 1.4, {body = {max_completion_tokens = 10,
                                                             max_tokens = 5000}}, now)
            out.uncapped = learned.tail_s("a", 1.4, {body = {max_tokens = 100000}}, now)
            return out
    """)
    assert got["prior"] == pytest.approx(2.0)
    # 10 % of the answers take 5 s: the 0.9 quantile sits between 1 and 5 s
    assert 1.0 < got["learned"] <= 5.0
    assert got["floor"] == pytest.approx(9.0 + got["excess"]) and got["excess"] > 0
    assert got["floor_excess"] == pytest.approx(0.0, abs=0.01)
    assert got["ceiling"] == pytest.approx(0.8)
    assert got["decayed"] == pytest.approx(2 * 1.4, rel=0.01)
    assert 0.01 < got["pt"] < 0.05                               # 1-5 s over 100 tokens
    assert got["capped"] == pytest.approx(got["pt"] * 50)
    assert got["capped2"] == pytest.approx(got["pt"] * 10)
    assert got["uncapped"] == pytest.approx(got["learned"])


def test_learned_concurrency_has_a_ceiling_decays_and_yields(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local a = node("a", {slots = 4})
            -- one at a time for a while, then a queue shows at level 2: learned 1
            for _ = 1, 30 do answered("a", 1, 1.0) end
            for _ = 1, 30 do answered("a", 2, 2.0) end
            out.learned = speed.effective(a)
            local now = ngx.now()
            out.still = speed.effective(a, now + speed.LEARNED_STALE_S)
            out.decayed = speed.effective(a, now + speed.LEARNED_STALE_S
                                              + speed.LEARNED_HALF_LIFE_S)
            out.long_after = speed.effective(a, now + 3600)
            -- answers at 4 in flight come back as fast as alone: the model yields at once
            for _ = 1, 20 do answered("a", 4, 1.0) end
            out.yielded = speed.effective(a)
            for _ = 1, 30 do answered("a", 2, 2.0) end     -- the fits keep the floor
            out.floor_kept = speed.effective(a)
            return out
    """)
    assert got["learned"] == 1
    assert got["still"] == 1
    assert got["decayed"] == pytest.approx(4 + (1 - 4) * 0.5)
    assert got["long_after"] == pytest.approx(4, abs=0.01)
    assert got["yielded"] == 4
    assert got["floor_kept"] == 4


def test_admission_predicts_the_requests_own_time_at_the_tail(workdir: Path) -> None:
    got = run(workdir, """
            local shed = require("infergate.admission.shed")
            local now = ngx.now()
            local att = stats.open_attempt("a", now)
            stats.close_attempt(att, "ok", now, 1000)               -- mean 1 s
            local t = tbl({node("a", {score = nil})})
            local out = {}
            out.mean = shed.best_prediction(t, now, nil)
            out.prior = shed.best_prediction(t, now, nil, {})       -- no tail learned: 2 x
            for i = 1, 300 do learned.observe("a", (i % 5 == 0) and 4.0 or 1.0, 100, now) end
            out.tail = shed.best_prediction(t, now, nil, {})
            out.short = shed.best_prediction(t, now, nil, {body = {max_tokens = 20}})
            out.stream_done, out.stream_wait = shed.best_prediction(t, now, nil, {stream = true})
            out.pt = learned.info("a").pt
            -- the queue's prediction: one slot, one ahead
            local one = tbl({node("a", {slots = 1, score = nil})})
            busy("a", 1)
            out.done, out.wait = slots.predict(one, now, {}, 1)
            out.sdone, out.swait = slots.predict(one, now, {stream = true}, 1)
            return out
    """)
    assert got["mean"] == pytest.approx(1.0)
    assert got["prior"] == pytest.approx(2.0)
    assert 3.0 < got["tail"] < 4.5                           # a fifth of the answers take 4 s
    assert got["short"] == pytest.approx(got["pt"] * 20)
    # a stream need only start in time: its own answer time does not count
    assert got["stream_done"] == pytest.approx(got["stream_wait"])
    assert got["wait"] == pytest.approx(2.0)                 # the one in flight, then one ahead
    assert got["done"] == pytest.approx(2.0 + got["tail"])
    assert got["sdone"] == pytest.approx(got["swait"]) and got["swait"] == pytest.approx(2.0)


def test_the_queue_prediction_yields_to_slots_seen_freeing_faster(workdir: Path) -> None:
    """infergate.admission.freerate: slots seen freeing up (while requests wait) more than
    FREE_YIELD_RATIO times faster than the nodes' figures say make the prediction yield
    (wait and own time shrink by the same factor, FREE_YIELD_MAX at most); slower, too
    few gaps, a gap without a queue, or a stale record change nothing."""
    got = run(workdir, """
            local freerate = require("infergate.admission.freerate")
            local now = ngx.now()
            local att = stats.open_attempt("a", now)
            stats.close_attempt(att, "ok", now, 1000)               -- mean 1 s: 1 slot/s
            local one = tbl({node("a", {slots = 1, score = nil})})
            busy("a", 1)
            local out = {}
            out.base_done, out.base_wait = slots.predict(one, now, {}, 3)
            local clock = now - 100
            local function ends(n, gap, waiting)
                for _ = 1, n do
                    clock = clock + gap
                    freerate.ended("", clock, waiting)
                end
                return clock
            end
            local last = ends(5, 0.125, true)                       -- too few gaps yet
            out.few_done = slots.predict(one, last, {}, 3)
            last = ends(60, 0.125, true)                            -- 8 slots/s seen
            out.fast_done, out.fast_wait = slots.predict(one, last, {}, 3)
            out.rate = freerate.rate("", last)
            out.stale = freerate.rate("", last + 5) == nil
            freerate.ended("", last + 0.1, false)                   -- the queue emptied
            out.after_idle = freerate.rate("", last + 0.1) == nil
            last = ends(60, 1.2, true)                              -- slower than 1/s
            out.slow_done = slots.predict(one, last, {}, 3)
            return out
    """)
    assert got["base_wait"] == pytest.approx(4.0)           # the one in flight + 3 ahead, 1/s
    assert got["few_done"] == pytest.approx(got["base_done"])
    assert got["rate"] == pytest.approx(8.0, rel=0.05)
    # 8x faster, held to FREE_YIELD_MAX = 4: wait and own time a quarter
    assert got["fast_wait"] == pytest.approx(1.0, rel=0.01)
    assert got["fast_done"] == pytest.approx(got["base_done"] / 4, rel=0.01)
    assert got["stale"] is True and got["after_idle"] is True
    assert got["slow_done"] == pytest.approx(got["base_done"])


def test_the_free_rate_counts_slots_held_and_answered_and_reads_paired_ends_right(
        workdir: Path) -> None:
    """infergate.admission.freerate: only a request that held a slot (req.picked) and got a
    2xx counts as a slot freed (a burst of 429s from the queue, or fast errors, would read
    as slots freeing up by the dozen); slots that end in pairs (gaps 0, s, 0, s, ...) read
    as their true rate from the first counted gaps on, so a pool at its figures' speed
    never yields."""
    got = run(workdir, """
            local freerate = require("infergate.admission.freerate")
            local queue = require("infergate.admission.queue")
            local now = ngx.now()
            local out = {}
            -- 2 slots answering in 1 s: 2 slots/s, ends in pairs
            local att = stats.open_attempt("a", now)
            stats.close_attempt(att, "ok", now, 1000)
            local two = tbl({node("a", {slots = 2, score = nil})})
            busy("a", 2)
            out.base_done = slots.predict(two, now, {}, 3)
            local clock = now - 20
            out.max_pair_rate = 0
            for i = 1, 12 do
                clock = clock + (i % 2 == 1 and 1.0 or 0.001)
                freerate.ended("", clock, true)
                out.max_pair_rate = math.max(out.max_pair_rate, freerate.rate("", clock) or 0)
            end
            out.paired_done = slots.predict(two, clock, {}, 3)
            -- the log hook: a shed request (no slot held) and an error count nothing
            local orig = queue.empty
            queue.empty = function() return false end       -- someone waits
            for _ = 1, 30 do freerate.log({slot_pool = true, model = "m"}, 429) end
            out.shed_counted = ngx.shared.infergate_stats:get("qfr:m") ~= nil
            for _ = 1, 30 do
                freerate.log({slot_pool = true, model = "m", picked = {name = "a"}}, 502)
            end
            out.error_counted = ngx.shared.infergate_stats:get("qfr:m") ~= nil
            freerate.log({slot_pool = true, model = "m", picked = {name = "a"}}, 200)
            out.ok_counted = ngx.shared.infergate_stats:get("qfr:m") ~= nil
            queue.empty = orig
            return out
    """)
    # ends in pairs at the figures' own 2 slots/s: never read as more than 1.5x that
    assert got["max_pair_rate"] < 1.5 * 2, got
    assert got["paired_done"] == pytest.approx(got["base_done"])
    assert got["shed_counted"] is False and got["error_counted"] is False
    assert got["ok_counted"] is True


def test_a_silent_nodes_free_slots_do_not_count_while_a_live_node_is_full(workdir: Path) -> None:
    """slots.free and slots.predict: a node found silent (here flagged a TTFB outlier)
    is not picked while a live node is merely full, so its free slots do not count for a
    waiting request (which would otherwise never get its 429 before giving up); with
    no live node left they count again."""
    got = run(workdir, """
            local now = ngx.now()
            local t = tbl({node("a", {slots = 2}), node("s", {slots = 2})})
            t.by_name = {a = t.nodes[1], s = t.nodes[2]}
            local att = stats.open_attempt("a", now)
            stats.close_attempt(att, "ok", now, 500)          -- a answers in 0.5 s
            busy("a", 2)                                      -- the live node is full
            local out = {}
            out.before = slots.free(t, now)
            ngx.shared.infergate_stats:set("ol:s", now)       -- s found a TTFB outlier
            out.silent = slots.free(t, now)
            out.reserve = slots.reserve({tried = {}}, t, now)
            local done, wait = slots.predict(t, now, {}, 0)
            out.wait = wait
            t.nodes[1].healthy = false                        -- no live node left
            out.alone = slots.free(t, now)
            return out
    """)
    assert got["before"] == 2
    assert got["silent"] == 0
    assert got["reserve"] is False
    assert got["wait"] == pytest.approx(0.25)                # a's next slot, not s's free one
    assert got["alone"] == 2


def _one_of_a_busy(workdir: Path, other: str, other_slots: int, body: str):
    """Runs `body` on a pool of "a" (2 slots, 1 busy) and `other` (`other_slots` free),
    with `now`, `t` and `out` set."""
    return run(workdir, """
            local now = ngx.now()
            local t = tbl({node("a", {slots = 2}), node("%s", {slots = %d})})
            t.by_name = {a = t.nodes[1], %s = t.nodes[2]}
            busy("a", 1)
            local out = {}
    """ % (other, other_slots, other) + body + """
            return out
    """)


def test_an_answer_under_way_that_waits_gets_the_next_free_slot(workdir: Path) -> None:
    """slots.mark_started_waiting (a relayed stream's retry or continuation waiting for a
    slot): while the mark lasts, a new request does not take the last free slot, but
    takes one of two; the mark lasts three polls and expires by itself."""
    got = _one_of_a_busy(workdir, "b", 1, """
            slots.mark_started_waiting(nil, now, 0.02)
            out.two_free = slots.reserve({tried = {}}, t, now)       -- takes one of the two
            out.last_free = slots.reserve({tried = {}}, t, now)      -- left to the waiting one
            out.expired = slots.reserve({tried = {}}, t, now + 0.07) -- three polls later
    """)
    assert got == {"two_free": True, "last_free": False, "expired": True}


def test_the_waiting_answers_node_left_out_does_not_count_for_the_mark(workdir: Path) -> None:
    """The mark names the nodes the waiting answer leaves out (the node it failed on, a
    restarted node whose slots show free): the last free slot of the other nodes is left
    to it, however many that node has free, and a new request takes one of those."""
    got = _one_of_a_busy(workdir, "r", 4, """
            slots.mark_started_waiting(nil, now, 0.02, {r = true})
            out.only_a = slots.reserve({tried = {r = true}}, t, now)   -- a's last: left
            local req = {tried = {}}
            out.new = slots.reserve(req, t, now)
            out.new_on = req.picked and req.picked.name
            slots.mark_started_waiting(nil, now, 0.02, {})           -- none left out
            out.all_counted = slots.reserve({tried = {}}, t, now)    -- 1 + 3 free: takes one
    """)
    assert got == {"only_a": False, "new": True, "new_on": "r", "all_counted": True}
