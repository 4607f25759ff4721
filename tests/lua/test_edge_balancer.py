"""Pure logic of the edge (no network): the balancer's cost and pick, the circuit
breaker's state machine and the attempt accounting, run in nginx's init_by_lua
(support.stack.lua_eval) with real shared dicts and explicit clocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"

PRELUDE = """
            local config = require("infergate.core.config")
            assert(config.init({edge = {breaker_failures = 3, breaker_cooldown_s = 10,
                                        inflight_cost = 1, stale_after_s = 10},
                                scoring = {latency_norm_s = 30}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local stats = require("infergate.routing.stats")
            local breaker = require("infergate.routing.breaker")
            local balancer = require("infergate.routing.balancer")
            local function node(name, extra)
                local n = {name = name, addr = "127.0.0.1", host = "127.0.0.1", port = 1,
                           state = "active", healthy = true, weight = 1, effective_weight = 1,
                           max_concurrency = 10, score = 0, saturated = false}
                for k, v in pairs(extra or {}) do n[k] = v end
                return n
            end
            local function tbl(nodes, fresh)
                return {source = "redis", generated_at = fresh and ngx.now() or ngx.now() - 100,
                        nodes = nodes}
            end
            local function count_picks(t, rounds, retry)
                local counts = {}
                for _ = 1, rounds do
                    local n = balancer.pick(t, {}, ngx.now(), retry)
                    local k = n and n.name or "none"
                    counts[k] = (counts[k] or 0) + 1
                end
                return counts
            end
"""


def run(workdir: Path, body: str):
    return lua_eval(workdir, PRELUDE + body, http_extra=DICTS)


def test_cost_formula(workdir: Path) -> None:
    got = run(workdir, """
            local now = ngx.now()
            local o = config.get()
            local a = node("a", {score = 0.2})
            stats.open_attempt("a", now); stats.open_attempt("a", now)      -- 2 in flight of 10
            local sat = node("s", {score = 0.2, saturated = true})
            local fresh_a = balancer.cost(a, true, o, now)
            local fresh_sat = balancer.cost(sat, true, o, now)
            -- stale / no score: latency EWMA (3 s of 30 s) + failure rate
            local b = node("b", {score = 0.9})
            local att = stats.open_attempt("b", now)
            stats.close_attempt(att, "ok", now, 3000)
            local stale_b = balancer.cost(b, false, o, now)
            local f = node("f")
            stats.close_attempt(stats.open_attempt("f", now), "fail", now)
            local stale_f = balancer.cost(f, false, o, now)
            local fresh_f = balancer.cost(node("f", {score = 0}), true, o, now)
            return {fresh_a = fresh_a, fresh_sat = fresh_sat, stale_b = stale_b,
                    stale_f = stale_f, fresh_f = fresh_f}
    """)
    assert got["fresh_a"] == pytest.approx(0.2 + 2 / 10)
    assert got["fresh_sat"] == pytest.approx(0.2 + 1.0)
    assert got["stale_b"] == pytest.approx(3 / 30)          # score ignored when stale
    assert got["stale_f"] == pytest.approx(0.3)             # failure EWMA after one failure
    assert got["fresh_f"] == pytest.approx(0.0)             # fresh score: the breaker's job


def test_pick_respects_eligibility_and_costs(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local t = tbl({node("busy", {score = 0.9}), node("b", {score = 0.1}),
                           node("c", {score = 0.1}), node("sick", {healthy = false}),
                           node("drain", {state = "draining"}), node("noaddr", {addr = false})}, true)
            out.fresh = count_picks(t, 300)
            out.stale = count_picks(tbl(t.nodes, false), 300)
            local n = balancer.pick(t, {b = true, c = true}, ngx.now())
            out.only_left = n and n.name
            out.none = balancer.pick(t, {b = true, c = true, busy = true}, ngx.now()) == nil
            out.eligible = balancer.count_eligible(t, {}, ngx.now())
            return out
    """)
    assert "busy" not in got["fresh"]                       # always paired with a cheaper node
    assert got["fresh"]["b"] > 100 and got["fresh"]["c"] > 100
    assert got["stale"]["busy"] > 50                        # stale: scores ignored
    assert set(got["fresh"]) | set(got["stale"]) == {"busy", "b", "c"}
    assert got["only_left"] == "busy" and got["none"] is True
    assert got["eligible"] == 3


def test_weights_and_inflight_spread_the_picks(workdir: Path) -> None:
    got = run(workdir, """
            local t = tbl({node("light", {effective_weight = 0.1, score = false}),
                           node("b", {score = false}), node("c", {score = false})}, true)
            local w = count_picks(t, 600)
            -- in-flight on b makes c win every b/c pairing
            for _ = 1, 5 do stats.open_attempt("b", ngx.now()) end
            local t2 = tbl({node("b"), node("c")}, true)
            return {w = w, inflight = count_picks(t2, 100)}
    """)
    assert got["w"].get("light", 0) < 100 < got["w"]["b"] and got["w"]["c"] > 100
    assert got["inflight"] == {"c": 100}


def test_breaker_state_machine(workdir: Path) -> None:
    got = run(workdir, """
            local t0 = ngx.now()
            local s = {}
            local function fail(at, probe)
                local a = stats.open_attempt("x", t0 + (at or 0), probe)
                stats.close_attempt(a, "fail", t0 + (at or 0))
            end
            fail(); fail()
            s[#s + 1] = breaker.state("x", t0)                              -- closed (2 < 3)
            fail()
            s[#s + 1] = breaker.state("x", t0)                              -- open
            s[#s + 1] = tostring(breaker.allow("x", t0 + 5))                -- false: cooling down
            s[#s + 1] = breaker.state("x", t0 + 10)                         -- half_open
            s[#s + 1] = tostring(breaker.allow("x", t0 + 10))               -- probe
            s[#s + 1] = tostring(breaker.take_probe("x"))                   -- true
            s[#s + 1] = tostring(breaker.take_probe("x"))                   -- false: one at a time
            s[#s + 1] = tostring(breaker.allow("x", t0 + 10))               -- false while probing
            fail(10, true)                                                  -- probe fails
            s[#s + 1] = breaker.state("x", t0 + 15)                         -- open again
            s[#s + 1] = breaker.state("x", t0 + 20)                         -- half_open
            assert(breaker.take_probe("x"))
            local a = stats.open_attempt("x", t0 + 20, true)
            stats.close_attempt(a, "ok", t0 + 20, 5)                        -- probe succeeds
            s[#s + 1] = breaker.state("x", t0 + 20)                         -- closed
            s[#s + 1] = tostring(breaker.allow("x", t0 + 20))               -- yes
            s[#s + 1] = tostring(stats.failure_rate("x", t0 + 20))          -- reset to 0
            -- a success between failures resets the count
            fail(21); fail(21)
            stats.close_attempt(stats.open_attempt("x", t0 + 21), "ok", t0 + 21, 5)
            fail(21); fail(21)
            s[#s + 1] = breaker.state("x", t0 + 21)                         -- closed
            -- a busy (429) answer is no failure for the breaker
            for _ = 1, 5 do stats.close_attempt(stats.open_attempt("y", t0), "busy", t0) end
            s[#s + 1] = breaker.state("y", t0)
            return s
    """)
    assert got == ["closed", "open", "false", "half_open", "probe", "true", "false", "false",
                   "open", "half_open", "closed", "yes", "0", "closed", "closed"]


def test_retry_never_takes_the_probe(workdir: Path) -> None:
    got = run(workdir, """
            local now = ngx.now()
            for _ = 1, 3 do stats.close_attempt(stats.open_attempt("p", now - 20), "fail", now - 20) end
            local t = tbl({node("p"), node("q")}, true)
            local retry_pick = balancer.pick(t, {}, now, true)
            local first, probe = balancer.pick(t, {}, now, false)
            return {retry = retry_pick.name, first = first.name, probe = probe}
    """)
    assert got == {"retry": "q", "first": "p", "probe": True}


def test_when_every_breaker_is_open_one_probe_goes_early(workdir: Path) -> None:
    """As nginx never marks the only server of an upstream down: when no node of the
    model has a closed breaker, a node open for ALONE_PROBE_S (1 s) takes one probe before
    its 10 s cooldown ends, rather than a 503; never while another node is closed, never
    by a retry, one at a time."""
    got = run(workdir, """
            local now = ngx.now()
            local function trip(name, at)
                for _ = 1, 3 do
                    stats.close_attempt(stats.open_attempt(name, at), "fail", at)
                end
            end
            local s = {}
            trip("p", now - 0.5)                    -- opened 0.5 s ago
            local alone = tbl({node("p")}, true)
            local two = tbl({node("p"), node("q")}, true)
            s.too_soon = balancer.count_eligible(alone, {}, now)
            s.too_soon_pick = balancer.pick(alone, {}, now, false) == nil
            trip("p", now - 2)                      -- (already open: stays opened 0.5 s ago)
            s.later = balancer.count_eligible(alone, {}, now + 1)
            s.retry = balancer.pick(alone, {}, now + 1, true) == nil
            s.other_closed = balancer.pick(two, {}, now + 1, false).name
            local n, probe = balancer.pick(alone, {}, now + 1, false)
            s.first, s.probe = n.name, probe
            s.second = balancer.pick(alone, {}, now + 1, false) == nil
            s.state = breaker.state("p", now + 1)   -- still open: the probe decides
            return s
    """)
    assert got == {"too_soon": 0, "too_soon_pick": True, "later": 1, "retry": True,
                   "other_closed": "q", "first": "p", "probe": True, "second": True,
                   "state": "open"}


def test_attempts_close_exactly_once(workdir: Path) -> None:
    got = run(workdir, """
            local now = ngx.now()
            local a = stats.open_attempt("z", now)
            local b = stats.open_attempt("z", now)
            local mid = stats.inflight("z")
            local first = stats.close_attempt(a, "aborted", now)
            local again = stats.close_attempt(a, "fail", now)
            stats.close_attempt(b, "ok", now, 10)
            return {mid = mid, first = first, again = again, after = stats.inflight("z"),
                    requests = stats.requests("z"), failures = stats.failures("z")}
    """)
    assert got == {"mid": 2, "first": True, "again": False, "after": 0, "requests": 2, "failures": 0}


def test_upstream_list_parsing(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local last = require("infergate.log").last_entry
            return {last("502, 504 : 200"), last("200"), last("-"), last("") or "nil",
                    last("0.001, 0.600")}
    """, http_extra=DICTS)
    assert got == ["200", "200", "-", "nil", "0.600"]


def test_two_nodes_split_by_weight_when_idle(workdir: Path) -> None:
    # With two eligible nodes both are always sampled: the weights shape the shares, and
    # the slow-start ramp (effective_weight below weight) acts once, on whether the node
    # takes part in a pick, not on its cost as well.
    got = run(workdir, """
            local t = tbl({node("ramp", {effective_weight = 0.25}), node("full")}, true)
            local idle = count_picks(t, 1000)
            local heavy = tbl({node("two", {weight = 2, effective_weight = 2}), node("one")}, true)
            local by_weight = count_picks(heavy, 1000)
            -- 1 in flight on the ramping node costs 1 / 10, less than 3 on the full node
            stats.open_attempt("ramp", ngx.now())
            for _ = 1, 3 do stats.open_attempt("full", ngx.now()) end
            return {idle = idle, loaded = count_picks(t, 1000), by_weight = by_weight}
    """)
    # in slow start the node takes part in a pick with probability 0.25 (effective
    # weight / weight), then wins half of the idle ties (weights 1 and 1): 125 of 1000;
    # with fewer in flight it wins whenever it takes part: 250 of 1000
    assert 80 < got["idle"]["ramp"] < 175
    assert 190 < got["loaded"]["ramp"] < 310
    assert 590 < got["by_weight"]["two"] < 740          # 2 / 3 of the idle ties


def test_a_node_in_slow_start_is_left_out_in_proportion_but_never_leaves_none(
        workdir: Path) -> None:
    # an idle node returning from a drain is the cheapest (score 0 against busy nodes):
    # the ramp must still hold its share down; alone, it takes every request
    got = run(workdir, """
            -- local signals only (no score): every candidate is costed, the idle one wins
            for _ = 1, 2 do stats.open_attempt("b", ngx.now()); stats.open_attempt("c", ngx.now()) end
            local function three(ew)
                return tbl({node("back", {effective_weight = ew, score = false}),
                            node("b", {score = false}), node("c", {score = false})}, true)
            end
            local alone = tbl({node("back", {effective_weight = 0.1})}, true)
            return {full = count_picks(three(1), 200), mixed = count_picks(three(0.1), 1000),
                    alone = count_picks(alone, 50), retry = count_picks(alone, 50, true)}
    """)
    assert got["full"] == {"back": 200}
    assert 50 < got["mixed"]["back"] < 160                   # expected 100 of 1000 (0.1)
    assert got["alone"] == {"back": 50} and got["retry"] == {"back": 50}
