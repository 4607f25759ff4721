"""The expected-delay cost (edge.node_cost = "expected_delay"): the service time a node
is learned to need (infergate.routing.speed), the predicted completion of one more
request there, how the balancer picks on it, and that the TTFB outlier ring ignores
attempts that queued behind the edge's own requests; run in nginx's init_by_lua with
real shared dicts (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stack import lua_eval, lua_node_helpers

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def run(workdir: Path, body: str, node_cost: str = "expected_delay"):
    prelude = """
            local config = require("infergate.core.config")
            assert(config.init({edge = {node_cost = \"""" + node_cost + """\",
                                        stale_after_s = 10, outlier_ttfb_factor = 4,
                                        outlier_ttfb_min_s = 2}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local stats = require("infergate.routing.stats")
            local speed = require("infergate.routing.speed")
            local balancer = require("infergate.routing.balancer")
            local outlier = require("infergate.routing.outlier")
""" + lua_node_helpers(max_concurrency=8, score=0.1) + """
            local learned = require("infergate.routing.learned")
            -- one successful attempt of `lat` s that started with k in flight on `name`
            -- (tokens: its completion tokens, learned first as the log phase does)
            local function answered(name, k, lat, tokens)
                if tokens then learned.observe(name, lat, tokens) end
                speed.observe({node = name, k = k}, lat * 1000, tokens)
            end
            -- `n` attempts left in flight on `name`
            local function busy(name, n)
                for _ = 1, n do stats.open_attempt(name, ngx.now()) end
            end
            local function count_picks(t, rounds)
                local counts = {}
                for _ = 1, rounds do
                    local n = balancer.pick(t, {}, ngx.now(), false)
                    counts[n.name] = (counts[n.name] or 0) + 1
                end
                return counts
            end
"""
    return lua_eval(workdir, prelude + body, http_extra=DICTS)


def test_service_time_takes_the_queueing_out_of_queued_answers(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            answered("a", 1, 2.0)                 -- one answer: still warming up
            out.one = speed.service_s("a")
            answered("a", 5, 10.0)                -- five in flight: 5 x 2 s, one at a time
            out.lc = speed.learned("a")
            answered("a", 1, 1.0)                 -- third answer: the median
            out.warm = speed.service_s("a")
            answered("a", 1, 3.0)
            out.ewma = speed.service_s("a")
            answered("a", 1, 100.0)               -- one very long answer: clipped
            out.clipped = speed.service_s("a")
            out.none = speed.service_s("b")
            return out
    """)
    assert got.get("one") is None
    assert got["lc"] == 1
    assert got["warm"] == pytest.approx(2.0)           # of 2, 10 / 5, 1
    assert got["ewma"] == pytest.approx(2.0 + 0.1 * (3.0 - 2.0))
    assert got["clipped"] == pytest.approx(2.1 + 0.1 * (4 * 2.1 - 2.1))
    assert got.get("none") is None


def test_expected_completion_is_own_service_plus_the_work_ahead(workdir: Path) -> None:
    got = run(workdir, """
            for _ = 1, 30 do answered("a", 4, 0.5) end   -- runs 4 at once, 0.5 s each
            local a = node("a")
            local out = {lc = speed.learned("a"), idle = speed.expected_s(a)}
            busy("a", 3)
            out.three = speed.expected_s(a)              -- the 4th still runs at once
            busy("a", 5)
            out.eight = speed.expected_s(a)              -- 5 ahead of it, 4 at a time
            out.unknown = speed.expected_s(node("b"))
            return out
    """)
    assert got["lc"] == pytest.approx(4.0)
    assert got["idle"] == pytest.approx(0.5)
    assert got["three"] == pytest.approx(0.5)
    assert got["eight"] == pytest.approx(0.5 * (1 + 5 / 4))
    assert got.get("unknown") is None


def test_no_queueing_while_a_node_has_room_then_the_smallest_delay(workdir: Path) -> None:
    got = run(workdir, """
            for _ = 1, 30 do answered("fast", 4, 0.5); answered("slow", 4, 1.5) end
            local t = tbl({node("fast"), node("slow")})
            local out = {}
            out.idle = count_picks(t, 50)               -- nothing in flight: fast wins
            busy("fast", 3)                              -- 4th: still room on fast
            out.three = count_picks(t, 50)
            busy("fast", 1)                              -- fast full (4 at once): the slow
            out.full = count_picks(t, 50)                -- one has room, nothing queues
            busy("slow", 4)                              -- both full: the smallest delay
            out.both = count_picks(t, 50)                -- fast 0.5 x 5/4 < slow 1.5 x 5/4
            busy("fast", 12)                             -- 17th: 0.5 x (1 + 13/4) = 2.1 s
            out.sixteen = count_picks(t, 50)             -- > slow 1.9 s
            return out
    """)
    assert got["idle"] == {"fast": 50}
    assert got["three"] == {"fast": 50}
    assert got["full"] == {"slow": 50}
    assert got["both"] == {"fast": 50}
    assert got["sixteen"] == {"slow": 50}


def test_equal_nodes_share_and_load_cost_is_used_without_history(workdir: Path) -> None:
    got = run(workdir, """
            for _ = 1, 30 do answered("a", 4, 0.5); answered("b", 4, 0.52) end
            local t = tbl({node("a"), node("b")})
            local out = {seq = {}}
            for i = 1, 6 do                 -- picks stay in flight: they alternate
                local n = balancer.pick(t, {}, ngx.now(), false)
                stats.open_attempt(n.name, ngx.now())
                out.seq[i] = n.name
            end
            -- a node without a service time yet: the load cost (score + in-flight)
            local t2 = tbl({node("a", {score = 0.9}), node("new", {score = 0})})
            out.fallback = count_picks(t2, 20)
            -- nodes without a fresh score (no metrics): the load cost too
            local stale = {source = "redis", generated_at = ngx.now() - 100,
                           nodes = {node("a"), node("b")}}
            out.stale_delay = balancer.least_delay(stale.nodes, 2, 2, false, ngx.now())
            out.noscore_delay = balancer.least_delay({node("a", {score = false}),
                                                      node("b")}, 2, 2, true, ngx.now())
            return out
    """)
    seq = got["seq"]
    assert sorted(seq[:2]) == ["a", "b"] and sorted(seq) == ["a", "a", "a", "b", "b", "b"], seq
    assert got["fallback"] == {"new": 20}
    assert got.get("stale_delay") is None
    assert got.get("noscore_delay") is None


def test_load_cost_when_configured(workdir: Path) -> None:
    got = run(workdir, """
            for _ = 1, 30 do answered("fast", 4, 0.5); answered("slow", 4, 1.5) end
            -- the load cost: in-flight / max_concurrency + score; slow has the lower score
            local t = tbl({node("fast", {score = 0.5}), node("slow", {score = 0.1})})
            return count_picks(t, 30)
    """, node_cost="load")
    assert got == {"slow": 30}


def test_queued_attempts_do_not_raise_the_outlier_threshold(workdir: Path) -> None:
    got = run(workdir, """
            answered("n", 1, 0.2)                        -- learned: one at a time
            local function first_byte(k, ttfb)
                local now = ngx.now()
                local att = stats.open_attempt("n", now - ttfb)
                att.k = k
                outlier.track(att, true)
                outlier.first_byte({attempts = {att}})
                stats.close_attempt(att, "ok", now)
            end
            for _ = 1, 10 do first_byte(1, 0.1) end
            local out = {p90 = outlier.p90("n", true)}
            for _ = 1, 10 do first_byte(6, 3.0) end      -- waited behind five others
            out.p90_after_queued = outlier.p90("n", true)
            return out
    """)
    assert got["p90"] == pytest.approx(0.1, abs=0.01)
    assert got["p90_after_queued"] == pytest.approx(0.1, abs=0.01)


def _best_delay_body() -> str:
    return """
            for _ = 1, 30 do answered("fast", 4, 0.5); answered("slow", 4, 1.5) end
            local shed = require("infergate.admission.shed")
            local out = {}
            busy("fast", 11)                             -- 0.5 x (1 + 8/4) = 1.5 s
            busy("slow", 5)                              -- 1.5 x (1 + 2/4) = 2.25 s
            local t = tbl({node("fast"), node("slow")})
            out.best = shed.best_delay(t, ngx.now())
            out.drained = shed.best_delay(tbl({node("fast", {state = "drained"}),
                                               node("slow")}), ngx.now())
            out.new_node = shed.best_delay(tbl({node("fast"), node("new")}), ngx.now())
            out.saturated = shed.best_delay(tbl({node("fast", {saturated = true}),
                                                 node("slow")}), ngx.now())
            out.all_saturated = shed.best_delay(tbl({node("fast", {saturated = true})}),
                                                ngx.now())
            out.stale = shed.best_delay({source = "redis", generated_at = ngx.now() - 100,
                                         nodes = {node("fast")}}, ngx.now())
            return out
"""


def test_shedding_prices_the_best_node_as_the_balancer_does(workdir: Path) -> None:
    got = run(workdir, _best_delay_body())
    assert got["best"] == pytest.approx(1.5)
    assert got["drained"] == pytest.approx(2.25)         # only eligible nodes count
    assert got.get("new_node") is None                   # no service time: the caps decide
    assert got["saturated"] == pytest.approx(2.25)       # over the [scoring] caps: no room
    assert got.get("all_saturated") is None              # the caps decide: shed
    assert got.get("stale") is None


def test_shedding_by_delay_is_off_with_the_load_cost(workdir: Path) -> None:
    got = run(workdir, _best_delay_body(), node_cost="load")
    assert got.get("best") is None


def test_a_node_measured_slow_is_tried_again_once_its_estimate_has_aged(workdir: Path) -> None:
    got = run(workdir, """
            local d = ngx.shared.infergate_stats
            local out = {}
            for _ = 1, 3 do answered("slow", 1, 3.0); answered("fast", 1, 1.0) end
            local t = tbl({node("slow"), node("fast")})
            out.fresh = count_picks(t, 20)
            local now = ngx.now()
            out.at_grace = speed.aged_service_s("slow", now + speed.STALE_S)
            out.one_half_life = speed.aged_service_s("slow",
                                                     now + speed.STALE_S + speed.HALF_LIFE_S)
            speed._set_last_answer("slow", now - 20)  -- nothing answered there for 20 s
            out.aged = speed.expected_s(node("slow"))
            out.raw = speed.service_s("slow")
            out.stale = count_picks(t, 1)
            busy("slow", 1)                       -- the probe is in flight: no more ageing
            out.probing = speed.expected_s(node("slow"))
            answered("slow", 1, 3.0)              -- the probe answered: measured afresh
            out.after_probe = count_picks(t, 20)
            return out
    """)
    assert got["fresh"] == {"fast": 20}
    assert got["at_grace"] == pytest.approx(3.0)
    assert got["one_half_life"] == pytest.approx(1.5)
    assert got["aged"] == pytest.approx(3.0 * 0.5 ** ((20 - 5) / 5), rel=0.05)
    assert got["raw"] == pytest.approx(3.0)   # the status shows what was measured
    assert got["stale"] == {"slow": 1}
    assert got["probing"] == pytest.approx(3.0 * 2)    # one ahead of the next, one at a time
    assert got["after_probe"] == {"fast": 20}


def test_one_long_answer_does_not_make_a_node_look_slow(workdir: Path) -> None:
    got = run(workdir, """
            answered("a", 1, 5.0)                 -- a long stream is its first answer
            for _ = 1, 3 do answered("b", 1, 0.05) end
            local t = tbl({node("a", {score = 0.1}), node("b", {score = 0.5})})
            local out = {}
            out.warming = count_picks(t, 10)      -- "a" has no service time: load cost
            for _ = 1, 2 do answered("a", 1, 0.05) end
            out.a = speed.service_s("a")
            local seq = {}
            for i = 1, 4 do                       -- equal now: they alternate
                local n = balancer.pick(t, {}, ngx.now(), false)
                stats.open_attempt(n.name, ngx.now())
                seq[i] = n.name
            end
            out.seq = seq
            return out
    """)
    assert got["warming"] == {"a": 10}            # lower score, nothing in flight
    assert got["a"] == pytest.approx(0.05)
    assert sorted(got["seq"]) == ["a", "a", "b", "b"], got["seq"]

def test_retry_after_is_the_predicted_wait_up_to_a_cap(workdir: Path) -> None:
    # A node at its max_concurrency (2) whose answers take 20 s: the next request waits
    # 20 s there (Retry-After 20); at 100 s a wait (a node slowed down or stopped), the
    # prediction says little about its recovery and Retry-After is capped.
    got = lua_eval(workdir, """
            local config = require("infergate.core.config")
            assert(config.init({edge = {node_cost = "load", stale_after_s = 10},
                                admission = {max_wait_ms = 0}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local stats = require("infergate.routing.stats")
            local snapshot = require("infergate.routing.snapshot")
            local shed = require("infergate.admission.shed")
            local cjson = require("cjson.safe")
            assert(snapshot.store(cjson.encode({version = 1, generated_at = ngx.now(),
                nodes = {{name = "a", host = "127.0.0.1", port = 1, max_concurrency = 2}}}),
                ngx.now()))
            local out = {}
            for _, lat in ipairs({20, 100}) do
                local d = ngx.shared.infergate_stats
                d:flush_all()
                for _ = 1, 5 do
                    local att = stats.open_attempt("a", ngx.now())
                    stats.close_attempt(att, "ok", ngx.now(), lat * 1000)
                end
                for _ = 1, 3 do stats.open_attempt("a", ngx.now()) end
                local err = shed.step_shed({route = "inference", deadline = {at = ngx.now() + 5}})
                out[tostring(lat)] = err and err.headers["Retry-After"]
            end
            out.cap = shed.RETRY_AFTER_MAX_S
            return out
    """, http_extra=DICTS + " lua_shared_dict infergate_limits 1m;")
    assert got["cap"] == 30
    assert got["100"] == "30"
    assert got["20"] == "20", got                       # 2 ahead, 2 at a time, 20 s each


def test_retry_after_waits_at_most_the_breaker_cooldown_while_a_node_is_out(workdir) -> None:
    """The same 20 s predicted wait while another node of the model is out for ill health
    (unhealthy in the snapshot, or its breaker open), not drained: Retry-After is the
    breaker's cooldown (a restarted node is back sooner than the queue drains)."""
    got = lua_eval(workdir, """
            local config = require("infergate.core.config")
            assert(config.init({edge = {node_cost = "load", stale_after_s = 10,
                                        breaker_cooldown_s = 4},
                                admission = {max_wait_ms = 0}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local stats = require("infergate.routing.stats")
            local snapshot = require("infergate.routing.snapshot")
            local shed = require("infergate.admission.shed")
            local cjson = require("cjson.safe")
            local out = {}
            local d = ngx.shared.infergate_stats
            for _, case in ipairs({"unhealthy", "breaker", "draining"}) do
                local b = {name = "b", host = "127.0.0.1", port = 2, max_concurrency = 2,
                           healthy = case ~= "unhealthy",
                           state = case == "draining" and "draining" or "active"}
                assert(snapshot.store(cjson.encode({version = 1, generated_at = ngx.now(),
                    nodes = {{name = "a", host = "127.0.0.1", port = 1, max_concurrency = 2}, b}}),
                    ngx.now()))
                d:flush_all()
                for _ = 1, 5 do
                    local att = stats.open_attempt("a", ngx.now())
                    stats.close_attempt(att, "ok", ngx.now(), 20000)
                end
                for _ = 1, 3 do stats.open_attempt("a", ngx.now()) end
                if case == "breaker" then d:set("bo:b", ngx.now()) end
                local err = shed.step_shed({route = "inference", deadline = {at = ngx.now() + 5}})
                out[case] = err and err.headers["Retry-After"]
            end
            return out
    """, http_extra=DICTS + " lua_shared_dict infergate_limits 1m;")
    assert got == {"unhealthy": "4", "breaker": "4", "draining": "20"}, got


def test_equal_nodes_show_equal_service_times_whichever_got_the_long_answers(
        workdir: Path) -> None:
    got = run(workdir, """
            -- four nodes of 0.1 s + 20 ms a token: a mix of lengths first, then "a" gets
            -- the 200-token answers and "b" the 10-token ones; "c" and "d" the same
            -- without their tokens known
            local out = {}
            for i = 1, 40 do
                local t = 10 + (i % 3) * 95
                for _, name in ipairs({"a", "b"}) do answered(name, 1, 0.1 + 0.02 * t, t) end
                for _, name in ipairs({"c", "d"}) do answered(name, 1, 0.1 + 0.02 * t) end
            end
            out.mixed = speed.service_s("a")
            for _ = 1, 20 do
                answered("a", 1, 0.1 + 0.02 * 200, 200)
                answered("b", 1, 0.1 + 0.02 * 10, 10)
                answered("c", 1, 0.1 + 0.02 * 200)
                answered("d", 1, 0.1 + 0.02 * 10)
            end
            out.a, out.b = speed.service_s("a"), speed.service_s("b")
            out.c, out.d = speed.service_s("c"), speed.service_s("d")
            -- an answer far past the clip: its length ratio is clipped with it
            answered("a", 1, 0.1 + 0.02 * 2000, 2000)
            out.a_clipped = speed.service_s("a")
            return out
    """)
    assert got["a"] == pytest.approx(got["b"], rel=0.1)
    assert got["a"] == pytest.approx(got["mixed"], rel=0.1)
    assert got["c"] > 3 * got["d"]          # without the tokens: which got the long ones
    # an answer far longer than the rest can make the node look a little slower, never
    # faster (its time clipped, its length ratio not, would have halved the estimate)
    assert got["a"] <= got["a_clipped"] <= 1.25 * got["a"]
