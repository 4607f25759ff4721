"""Where a request can still finish in time (infergate.routing.fit) and what admission
does with it: the tail of answer times as the node's mean plus a learned excess, answers cut by
their clients counted as longer ones (infergate.routing.learned), the slot a request
leaves to a node that would finish it too late (infergate.admission.slots.reserve), the
queue's prediction over the nodes that can finish a request (slots.predict) and the
requests ahead of a ticket (infergate.admission.queue.ahead); run in nginx's
init_by_lua with real shared dicts (support.stack.lua_eval)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.stack import lua_eval, lua_slot_prelude

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def run(workdir: Path, body: str):
    prelude = lua_slot_prelude({
        "learned": "infergate.routing.learned", "fit": "infergate.routing.fit",
        "slots": "infergate.admission.slots", "queue": "infergate.admission.queue",
        "deadline": "infergate.admission.deadline"}) + """
            local function mean(name, s)          -- the node's latency EWMA: s
                local att = stats.open_attempt(name, ngx.now())
                stats.close_attempt(att, "ok", ngx.now(), s * 1000)
            end
            -- a request with `left` s to its deadline of `whole` s (30 when nil)
            local function due(left, whole, extra)
                local r = {tried = {}, deadline = {at = ngx.now() + left,
                                                   request_ms = (whole or 30) * 1000}}
                for k, v in pairs(extra or {}) do r[k] = v end
                return r
            end
"""
    return lua_eval(workdir, prelude + body, http_extra=DICTS)


def test_the_tail_moves_with_the_mean_at_once(workdir: Path) -> None:
    """A node whose answers all take longer (its queue grew) has its tail move with its
    mean at once, the spread of its answers kept; a quantile of the times themselves,
    moved a few percent per answer, trailed them below the mean for dozens of answers."""
    got = run(workdir, """
            local now = ngx.now()
            local out = {}
            out.prior = learned.tail_s("a", 1.0, nil, now)
            for i = 1, 400 do learned.observe("a", (i % 10 == 0) and 3.0 or 1.0, nil, now) end
            out.excess = learned.info("a").e
            out.tail1 = learned.tail_s("a", 1.2, nil, now)
            for i = 1, 10 do learned.observe("a", (i % 10 == 0) and 5.0 or 3.0, nil, now) end
            out.excess_after = learned.info("a").e
            out.tail2 = learned.tail_s("a", 3.2, nil, now)
            out.capped = learned.tail_s("a", 0.1, nil, now)
            out.decayed = learned.tail_s("a", 1.0, nil, now + 60 + learned.HALF_LIFE_S * 20)
            return out
    """)
    assert got["prior"] == pytest.approx(2.0)
    # a tenth of the answers run about 1.8 s past the mean: the 0.9 quantile of the excess
    assert 0.2 < got["excess"] < 2.5
    assert got["tail1"] == pytest.approx(1.2 + got["excess"])
    # ten answers 2 s longer move the excess little: the tail moves with the mean
    assert got["excess_after"] == pytest.approx(got["excess"], abs=0.5)
    assert got["tail2"] == pytest.approx(3.2 + got["excess_after"])
    assert got["capped"] == pytest.approx(0.8)                 # at most 8 x the mean
    assert got["decayed"] == pytest.approx(2.0, rel=0.01)


def test_an_answer_cut_by_its_client_past_the_tail_raises_it(workdir: Path) -> None:
    """Answers clients stopped waiting for are the long ones: a cut past the tail counts as
    an answer past it, a cut before it says nothing (and nothing without a record)."""
    got = run(workdir, """
            local now = ngx.now()
            learned.observe_cut("none", 50, now)
            local out = {none = learned.info("none") == nil}
            for _ = 1, 50 do learned.observe("a", 1.0, nil, now) end
            out.before = learned.info("a").e
            learned.observe_cut("a", 1.2, now)
            out.short_cut = learned.info("a").e
            for _ = 1, 20 do learned.observe_cut("a", 30.0, now) end
            out.long_cut = learned.info("a").e
            return out
    """)
    assert got["none"] is True
    assert got["short_cut"] == pytest.approx(got["before"])
    assert got["long_cut"] > got["before"] + 0.5


def test_a_stream_counts_its_own_time_only_when_it_fits_a_whole_deadline(
        workdir: Path) -> None:
    """What is admitted finishes: a stream's own answer time counts as a non-stream's, but
    a stream whose answers alone outrun the whole deadline need only start in time, as
    does one whose deadline the client's timeout set (it bounds the wait for each read)."""
    got = run(workdir, """
            local function client(r)   -- a deadline the client's timeout set
                r.deadline.client = true
                return r
            end
            return {
                plain = deadline.own_s(due(10, 30), 12),
                stream = deadline.own_s(due(10, 30, {stream = true}), 12),
                long_stream = deadline.own_s(due(10, 30, {stream = true}), 45),
                no_deadline = deadline.own_s({stream = true}, 12),
                whole = deadline.whole_s(due(10, 30)),
                -- the deadline the client's timeout set bounds a stream's start only
                client_stream = deadline.own_s(client(due(10, 30, {stream = true})), 12),
                client_plain = deadline.own_s(client(due(10, 30)), 12),
            }
    """)
    assert got["plain"] == 12 and got["stream"] == 12
    assert got["long_stream"] == 0 and got["no_deadline"] == 0
    assert got["whole"] == 30
    assert got["client_stream"] == 0 and got["client_plain"] == 12


def test_a_slot_that_would_finish_too_late_waits_for_one_that_would_not(
        workdir: Path) -> None:
    """reserve(): a free slot on a node predicted to finish the request after its deadline
    is left while another node could finish it (the request waits for that one's slot),
    and marked for a request behind it with time enough; when no node could finish it in
    time the free slot is taken (a free slot never sheds), as it is by a request whose
    wait is over ("any"); without a deadline nothing changes."""
    got = run(workdir, """
            local t = tbl({node("fast", {slots = 1}), node("slow", {slots = 1})})
            t.by_name = {fast = t.nodes[1], slow = t.nodes[2]}
            mean("fast", 1.0)                    -- tail 2 s (the prior: 2 x the mean)
            mean("slow", 5.0)                    -- tail 10 s
            busy("fast", 1)                      -- fast's one slot is taken
            local now = ngx.now()
            local out = {}
            out.c_fast = fit.completion(t.nodes[1], now, due(5))
            out.c_slow = fit.completion(t.nodes[2], now, due(5))
            local tight = due(5)
            out.tight = slots.reserve(tight, t, now)
            out.marked = ngx.shared.infergate_stats:get("uf:slow") == true
            out.slow_after_tight = stats.inflight("slow")
            -- a younger request behind it, 20 s left: the slot it left is its
            local young = due(20)
            out.young = slots.reserve(young, t, now, "refused")
            out.young_node = young.picked and young.picked.name
            stats.release({node = "slow"})
            -- one with 6 s left takes only a slot left to it, and this one does not fit
            out.mid_refused_only = slots.reserve(due(6), t, now, "refused")
            -- 1.5 s left: no node finishes it in time, so the free slot is taken
            local hopeless = due(1.5)
            out.hopeless = slots.reserve(hopeless, t, now)
            out.hopeless_node = hopeless.picked and hopeless.picked.name
            stats.release({node = "slow"})
            ngx.shared.infergate_stats:delete("uf:slow")
            out.unmarked = slots.reserve(due(20), t, now, "refused")
            out.no_deadline = slots.reserve({tried = {}}, t, now)
            stats.release({node = "slow"})
            -- a request whose wait is over takes the free slot rather than a 429
            out.any = slots.reserve(due(5), t, now, "any")
            return out
    """)
    assert got["c_fast"] == pytest.approx(2.0) and got["c_slow"] == pytest.approx(10.0)
    assert got["tight"] is False and got["marked"] is True
    assert got["slow_after_tight"] == 0
    assert got["young"] is True and got["young_node"] == "slow"
    assert got["mid_refused_only"] is False
    assert got["hopeless"] is True and got["hopeless_node"] == "slow"
    assert got["unmarked"] is False                  # not left by anyone ahead: not its
    assert got["no_deadline"] is True
    assert got["any"] is True


def test_the_queue_prediction_counts_the_nodes_that_can_finish_a_request(
        workdir: Path) -> None:
    """slots.predict(): the queue drains at the rates of the nodes that could finish a
    request of a whole deadline (a node whose tail alone is past it serves no one in
    time), and the request then takes the fastest one's time."""
    got = run(workdir, """
            local t = tbl({node("fast", {slots = 2}), node("slow", {slots = 2})})
            mean("fast", 1.0)                    -- 2 slots a second, tail 2 s
            mean("slow", 20.0)                   -- tail 40 s: past a 30 s deadline
            busy("fast", 2)
            busy("slow", 2)
            local now = ngx.now()
            local out = {}
            out.done, out.wait = slots.predict(t, now, due(30), 3)
            -- a deadline of 60 s: the slow node can finish one, and adds its rate
            out.done60, out.wait60 = slots.predict(t, now, due(60, 60), 3)
            return out
    """)
    assert got["wait"] == pytest.approx(4 / 2.0)
    assert got["done"] == pytest.approx(got["wait"] + 2.0)
    assert got["wait60"] == pytest.approx(4 / 2.1)
    assert got["done60"] == pytest.approx(got["wait60"] + 2.0)


def test_tickets_that_left_behind_a_waiting_head_are_not_ahead(workdir: Path) -> None:
    """A run of 429s leaves tickets behind a waiting head: counted as waiting they would
    make the queue look long and shed the requests after them in turn."""
    got = run(workdir, """
            local t = {}
            for i = 1, 6 do t[i] = queue.join("p", 0.02) end
            local now = ngx.now()
            for i = 2, 5 do queue.leave("p", t[i], now) end     -- shed; t[1] still waits
            return {ahead = queue.ahead("p", t[6], now), head = queue.ahead("p", t[1], now),
                    length = queue.length("p")}
    """)
    assert got["head"] == 0
    assert got["ahead"] == 1
    assert got["length"] == 2
