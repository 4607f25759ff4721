"""Time-to-first-byte outlier detection in the edge's pure logic
(infergate.routing.outlier): the p90 ring, the threshold with its floor, when a node
counts as an outlier, and that an answer clears it; run in nginx's init_by_lua with real
shared dicts and explicit clocks (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def run(workdir: Path, body: str, factor: float = 4.0, floor: float = 2.0,
        stream_floor: float = 2.0):
    prelude = """
            local config = require("infergate.core.config")
            assert(config.init({edge = {outlier_ttfb_factor = """ + str(factor) + """,
                                        outlier_ttfb_min_s = """ + str(floor) + """,
                                        outlier_stream_ttfb_min_s = """ + str(stream_floor) + """}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local outlier = require("infergate.routing.outlier")
            local stats = require("infergate.routing.stats")
            local node = {name = "n"}
            -- an answered attempt of `ttfb` s (stream or not), ending at `now`
            local function answered(name, now, ttfb, stream)
                local att = stats.open_attempt(name, now - ttfb)
                outlier.track(att, stream)
                outlier.first_byte({attempts = {att}}, now)
                stats.close_attempt(att, "ok", now)
                return att
            end
"""
    return lua_eval(workdir, prelude + body, http_extra=DICTS)


def test_p90_of_the_ring_matches_the_sorted_rank(workdir: Path) -> None:
    # rings of every size up to SAMPLES, values with ties, in a scrambled order
    got = run(workdir, """
            local out = {}
            for n = 1, 20 do
                local ring = {}
                for k = 1, n do ring[k] = (k * 7) % 11 / 10 end
                out[n] = outlier._p90_of(ring, n)
            end
            return out
    """)
    for n in range(1, 21):
        vals = sorted(((k * 7) % 11) / 10 for k in range(1, n + 1))
        idx = max(1, -(-9 * n // 10))  # ceil(0.9 n), 1-based
        assert got[n - 1] == pytest.approx(vals[idx - 1]), n


def test_waiting_list_keeps_the_oldest_unanswered_attempt(workdir: Path) -> None:
    got = run(workdir, """
            local a, b, c = {node = "n", started = 1}, {node = "n", started = 2},
                            {node = "n", started = 3}
            for _, att in ipairs({a, b, c}) do outlier.track(att, false) end
            local out = {}
            local function oldest()
                local att = outlier._oldest_waiting("n")
                return att and att.started or 0
            end
            out[1] = oldest()                              -- a
            outlier.first_byte({attempts = {b}})           -- the middle one answers
            out[2] = oldest()                              -- still a
            outlier.finished(a, 10)                        -- the oldest ends
            out[3] = oldest()                              -- c
            c.closed = true                                -- ended without finished()
            out[4] = oldest()                              -- dropped: none
            local d = {node = "n", started = 4}
            outlier.track(d, false)
            out[5] = oldest()                              -- d, alone on the list
            outlier.finished(d, 11)
            outlier.finished(d, 12)                        -- twice: no harm
            out[6] = oldest()
            return out
    """)
    assert got == [1, 1, 3, 0, 4, 0]


def test_p90_and_threshold(workdir: Path) -> None:
    got = run(workdir, """
            local now = 1000
            local out = {none = outlier.threshold("n", false)}
            for i = 1, 10 do answered("n", now, i / 10, false) end   -- 0.1 .. 1.0 s
            out.p90 = outlier.p90("n", false)
            out.thr = outlier.threshold("n", false)
            out.stream_p90 = outlier.p90("n", true)
            for i = 1, 30 do answered("n", now, 0.05, false) end     -- the ring forgets
            out.p90_after = outlier.p90("n", false)
            out.thr_floor = outlier.threshold("n", false)
            return out
    """)
    assert got["none"] == 2.0                          # no history: the floor
    assert got["p90"] == pytest.approx(0.9)
    assert got["thr"] == pytest.approx(3.6)            # 4 x p90
    assert got.get("stream_p90") is None               # kinds apart
    assert got["p90_after"] == pytest.approx(0.05)
    assert got["thr_floor"] == 2.0


def test_streams_with_a_history_have_their_own_floor(workdir: Path) -> None:
    """A stream's first chunk does not grow with the answer, so once a node has a stream
    history its threshold floor is outlier_stream_ttfb_min_s; non-streams, and streams of
    a node without history, keep outlier_ttfb_min_s."""
    got = run(workdir, """
            local now = 1000
            local out = {stream_none = outlier.threshold("n", true)}
            for i = 1, 10 do answered("n", now, 0.05, true) end     -- p90 0.05 s
            for i = 1, 10 do answered("n", now, 0.05, false) end
            out.stream = outlier.threshold("n", true)
            out.plain = outlier.threshold("n", false)
            -- a stream silent for 1.5 s on a node silent as long: past the stream floor
            local t0 = now + 10
            local att = stats.open_attempt("n", t0)
            outlier.track(att, true)
            out.stream_early = outlier.is_outlier(node, t0 + 0.8)
            out.stream_late = outlier.is_outlier(node, t0 + 1.5)
            stats.close_attempt(att, "fail", t0 + 1.6)
            ngx.shared.infergate_stats:flush_all()
            -- the same wait on a non-streamed answer is not
            local t1 = t0 + 100
            for i = 1, 10 do answered("n", t1, 0.05, false) end
            local plain = stats.open_attempt("n", t1)
            outlier.track(plain, false)
            out.plain_wait = outlier.is_outlier(node, t1 + 1.5)
            out.plain_late = outlier.is_outlier(node, t1 + 5.5)
            return out
    """, floor=5.0, stream_floor=1.0)
    assert got["stream_none"] == 5.0                  # no stream history: the general floor
    assert got["stream"] == pytest.approx(1.0)        # 4 x 0.05 below the stream floor
    assert got["plain"] == pytest.approx(5.0)
    assert got["stream_early"] is False and got["stream_late"] is True
    assert got["plain_wait"] is False and got["plain_late"] is True


def test_outlier_needs_a_long_wait_and_no_answer_and_clears_on_an_answer(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local t0 = 1000
            for i = 1, 10 do answered("n", t0, 0.5, false) end      -- p90 0.5: threshold 2 s
            local stuck = stats.open_attempt("n", t0 + 1)
            outlier.track(stuck, false)
            out.early = outlier.is_outlier(node, t0 + 2.5)           -- waited 1.5 s
            out.late = outlier.is_outlier(node, t0 + 3.5)            -- waited 2.5 s
            out.flagged = outlier.flagged("n")
            -- a first byte of another request clears it at once
            answered("n", t0 + 3.6, 0.4, false)
            out.after_answer = outlier.is_outlier(node, t0 + 3.7)
            out.flag_after_answer = outlier.flagged("n")
            -- still waiting and silent for longer than the threshold: again
            out.again = outlier.is_outlier(node, t0 + 6)
            -- the stuck attempt ends (timeout): nothing waits, only the flag remains
            stats.close_attempt(stuck, "fail", t0 + 6)
            out.flag_kept = outlier.is_outlier(node, t0 + 6.1)
            -- a node with nothing in flight is never one
            out.other = outlier.is_outlier({name = "m"}, t0 + 100)
            -- the mark expired, still no answer: one request at a time
            ngx.shared.infergate_stats:delete("ol:n")
            out.idle_after_expiry = outlier.is_outlier(node, t0 + 30)
            local probe = stats.open_attempt("n", t0 + 30)
            outlier.track(probe, false)
            out.busy_after_expiry = outlier.is_outlier(node, t0 + 30.1)
            answered("n", t0 + 30.2, 0.2, false)                      -- it answers
            stats.close_attempt(probe, "ok", t0 + 30.3)
            local again = stats.open_attempt("n", t0 + 30.4)
            outlier.track(again, false)
            out.after_probe_answer = outlier.is_outlier(node, t0 + 30.5)
            return out
    """)
    assert got["early"] is False and got["late"] is True and got["flagged"] is True
    assert got["after_answer"] is False and got["flag_after_answer"] is False
    assert got["again"] is True and got["flag_kept"] is True
    assert got["other"] is False
    assert got["idle_after_expiry"] is False and got["busy_after_expiry"] is True
    assert got["after_probe_answer"] is False


def test_a_request_queued_behind_a_busy_batch_is_no_sign_of_a_hang(workdir: Path) -> None:
    """A request queued at the node behind this edge's full batch waits for its first
    byte as long as the batch takes: while bytes of the running answers arrive, the node
    is busy, not an outlier, also just as its turn comes; once no byte at all comes for
    the threshold, or once another answer ended after its turn came and it still has no
    first byte, it is one. A request the node had room for gets no such excuse."""
    got = run(workdir, """
            local out = {}
            local speed = require("infergate.routing.speed")
            local stall = require("infergate.routing.stall")
            local t0 = 1000
            for _ = 1, 20 do      -- both nodes run one request at a time
                speed.observe({node = "n", k = 1}, 1000); speed.observe({node = "n", k = 3}, 3000)
                speed.observe({node = "r", k = 1}, 1000); speed.observe({node = "r", k = 3}, 3000)
            end
            for i = 1, 10 do answered("n", t0, 0.5, true); answered("r", t0, 0.5, true) end
            local function running(name, at)      -- a stream under way, its first byte at `at`
                local att = stats.open_attempt(name, at)
                att.k = 1
                outlier.track(att, true)
                local req = {attempts = {att}, stream = true}
                outlier.first_byte(req, at)
                stall.byte(req, at)
                return req
            end
            local busy = running("n", t0 + 1)
            local busy2 = running("n", t0 + 1)
            local busy3 = running("n", t0 + 1)
            local queued = stats.open_attempt("n", t0 + 1)
            queued.k = 2                                            -- one place back
            outlier.track(queued, true)
            stall.byte(busy, t0 + 3.2)
            stall.byte(busy, t0 + 3.4)
            out.busy = outlier.is_outlier(node, t0 + 3.5)          -- waited 2.5 s: bytes flow
            out.silent = outlier.is_outlier(node, t0 + 5.5)        -- no byte for 2.1 s
            -- the answer before it ended: its turn came, and it may still read its prompt
            ngx.shared.infergate_stats:delete("ol:n")
            ngx.shared.infergate_stats:delete("os:n")
            stats.close_attempt(busy.attempts[1], "ok", t0 + 5.6)
            stall.byte(busy2, t0 + 5.6)
            stall.byte(busy2, t0 + 6.0)
            out.its_turn = outlier.is_outlier(node, t0 + 6.1)
            -- one more answer ended, the node still sends bytes of others and has started
            -- nothing new: an outlier again
            stats.close_attempt(busy2.attempts[1], "ok", t0 + 6.2)
            stall.byte(busy3, t0 + 8.4)
            out.turn_came = outlier.is_outlier(node, t0 + 8.5)
            -- on a node it had room on, the same wait is an outlier, bytes or not
            local other = running("r", t0 + 1)
            local alone = stats.open_attempt("r", t0 + 1)
            alone.k = 1
            outlier.track(alone, true)
            stall.byte(other, t0 + 3.4)
            out.room = outlier.is_outlier({name = "r"}, t0 + 3.5)
            return out
    """, stream_floor=2.0)
    assert got["busy"] is False
    assert got["silent"] is True
    assert got["its_turn"] is False
    assert got["turn_came"] is True
    assert got["room"] is True


def test_unanswered_probes_back_a_hung_node_off(workdir: Path) -> None:
    """A silent outlier gets one probe at a time; a probe that waited past the threshold
    and ended unanswered keeps the node out for threshold x 2^n (n probes in a row, at
    most PROBE_BACKOFF_MAX_S), a short one (the client left) does not, and an answer
    ends it all."""
    got = run(workdir, """
            local out = {}
            local d = ngx.shared.infergate_stats
            local t0 = 1000
            for i = 1, 10 do answered("n", t0, 0.5, false) end      -- threshold 2 s
            local stuck = stats.open_attempt("n", t0 + 1)
            outlier.track(stuck, false)
            out.found = outlier.is_outlier(node, t0 + 3.5)
            stats.close_attempt(stuck, "neutral", t0 + 7)           -- times out
            outlier.finished(stuck, t0 + 7)                         -- not a probe: sent before
            d:delete("ol:n")
            out.probe_allowed = outlier.is_outlier(node, t0 + 8)
            local function probe(at, ends)
                local p = stats.open_attempt("n", at)
                outlier.track(p, false)
                stats.close_attempt(p, "neutral", ends)
                outlier.finished(p, ends)
            end
            probe(t0 + 8, t0 + 14)                                  -- unanswered: 2 x 2^1 = 4 s
            out.backoff1 = outlier.is_outlier(node, t0 + 17.9)
            out.after1 = outlier.is_outlier(node, t0 + 18.1)
            probe(t0 + 18.1, t0 + 24)                               -- again: 2 x 2^2 = 8 s
            out.backoff2 = outlier.is_outlier(node, t0 + 31.9)
            out.after2 = outlier.is_outlier(node, t0 + 32.1)
            probe(t0 + 32.1, t0 + 32.5)                             -- left early: no backoff
            out.after_short = outlier.is_outlier(node, t0 + 32.6)
            for _ = 1, 10 do probe(t0 + 40, t0 + 50) end            -- capped
            out.capped = d:get("ou:n") - (t0 + 50)
            answered("n", t0 + 51, 0.3, false)                      -- it answers
            out.after_answer = outlier.is_outlier(node, t0 + 51.1)
            return out
    """)
    assert got["found"] is True and got["probe_allowed"] is False
    assert got["backoff1"] is True and got["after1"] is False
    assert got["backoff2"] is True and got["after2"] is False
    assert got["after_short"] is False
    assert got["capped"] == pytest.approx(60)
    assert got["after_answer"] is False


def test_factor_zero_turns_detection_off(workdir: Path) -> None:
    got = run(workdir, """
            local stuck = stats.open_attempt("n", 0)
            outlier.track(stuck, true)
            return outlier.is_outlier(node, 1000)
    """, factor=0)
    assert got is False


def test_learned_concurrency_from_queueing(workdir: Path) -> None:
    got = run(workdir, """
            local speed = require("infergate.routing.speed")
            local snapshot = require("infergate.routing.snapshot")
            local function sample(name, k, lat_s)
                speed.observe({node = name, k = k}, lat_s * 1000)
            end
            -- a server running one request at a time: the k-th waits k x 1 s
            for _ = 1, 20 do
                sample("serial", 1, 1.0); sample("serial", 4, 4.0); sample("serial", 2, 2.0)
            end
            -- a server running many at once: latency does not grow with k
            for _ = 1, 20 do
                sample("parallel", 1, 1.0); sample("parallel", 6, 1.05)
            end
            local maxc = {name = "serial", max_concurrency = 64}
            return {
                serial = speed.learned("serial"), parallel = speed.learned("parallel"),
                c_serial = speed.concurrency(maxc, false),
                c_scored = speed.concurrency(maxc, true),
                c_new = speed.concurrency({name = "new", max_concurrency = 64}, false),
                c_capped = speed.concurrency({name = "parallel", max_concurrency = 3}, false),
                no_k = speed.observe({node = "x"}, 1000) == nil and speed.learned("x") == nil,
            }
    """)
    assert got["serial"] == pytest.approx(1.0, abs=0.05)
    assert 3.0 < got["parallel"] <= 6.0
    assert got["c_serial"] == pytest.approx(2.0, abs=0.05)   # learned + 1, not 64
    assert got["c_scored"] == 64 and got["c_new"] == 64
    assert got["c_capped"] == 3
    assert got["no_k"] is True


def test_learned_concurrency_is_not_fooled_by_answer_lengths(workdir: Path) -> None:
    # Answers of 2 to 64 tokens on nodes that run 4 (or 1) at once: the k-th in flight
    # takes its own length times max(1, k / c); a node batching 4 also slows each step
    # by 4 % per sequence. The learned concurrency must find c, not a value pulled down
    # by the shortest answer seen.
    got = run(workdir, """
            local speed = require("infergate.routing.speed")
            speed.FIT_INTERVAL_S = 0
            local lengths = {2, 64, 8, 30, 4, 16, 50, 3, 12, 24}
            local function serve(name, c, slowdown)
                for round = 1, #lengths do         -- every level sees every length
                    for k = 1, 2 * c + 2 do
                        local len = lengths[(round + k) % #lengths + 1]
                        local step = 0.05 * (1 + slowdown * (math.min(k, c) - 1))
                        local lat = len * step * math.max(1, k / c)
                        speed.observe({node = name, k = k}, lat * 1000)
                    end
                end
                return speed.learned(name)
            end
            return {four = serve("four", 4, 0.04), one = serve("one", 1, 0),
                    eight = serve("eight", 8, 0.02)}
    """)
    assert got["four"] == 4 and got["one"] == 1
    # 8 at once, each step 14 % slower than alone: the 8th looks like 8/7 of a queue
    assert got["eight"] in (7, 8)


def test_a_quiet_node_gets_an_early_liveness_check_and_is_found_when_it_fails(
        workdir: Path) -> None:
    """infergate.routing.liveness early check: a plain http node with a request waiting
    for its first byte and no byte at all for liveness_suspect_s (1 s) is asked for a
    check long before its 5 s threshold; once that check got no answer the node is an
    outlier. A byte after the quiet spell began, or a check answered since, clears it;
    nodes that cannot be checked, and liveness_suspect_s = 0, ask for none."""
    got = run(workdir, """
            local liveness = require("infergate.routing.liveness")
            local d = ngx.shared.infergate_stats
            local out = {}
            local t0 = 1000
            local hn = {name = "h", scheme = "http", addr = "127.0.0.1", port = 9}
            for i = 1, 10 do answered("h", t0, 0.2, false) end      -- threshold: 5 s floor
            d:set("lb:h", t0 + 0.2)                                 -- its last byte
            local att = stats.open_attempt("h", t0 + 0.1)
            outlier.track(att, false)
            out.at_0_9 = {outlier.is_outlier(hn, t0 + 0.9), d:get("le:h") or false}
            out.at_1_3 = {outlier.is_outlier(hn, t0 + 1.3), d:get("le:h")}
            d:set("lx:h", d:get("le:h"))                            -- the check: no answer
            out.failed = outlier.is_outlier(hn, t0 + 2.3)
            out.flagged = outlier.flagged("h")
            -- the same on a node that sent a byte after the spell began: not found
            local m = {name = "m", scheme = "http", addr = "127.0.0.1", port = 9}
            answered("m", t0, 0.2, false)
            local am = stats.open_attempt("m", t0 + 0.1)
            outlier.track(am, false)
            outlier.is_outlier(m, t0 + 1.5)
            d:set("lx:m", d:get("le:m"))
            d:set("lb:m", t0 + 1.6)
            out.byte_since = outlier.is_outlier(m, t0 + 2.3)
            d:set("lb:m", t0 + 0.2)
            d:set("la:m", t0 + 1.9)                                 -- a later check answered
            out.answered_since = outlier.is_outlier(m, t0 + 2.3)
            -- no check for a node reached by name, nor with liveness_suspect_s = 0
            local nn = {name = "q", scheme = "http", port = 9}
            local aq = stats.open_attempt("q", t0)
            outlier.track(aq, false)
            outlier.is_outlier(nn, t0 + 3)
            out.by_name = d:get("le:q") == nil
            local o = config.get()
            o.edge.liveness_suspect_s = 0
            local z = {name = "z", scheme = "http", addr = "127.0.0.1", port = 9}
            local az = stats.open_attempt("z", t0)
            outlier.track(az, false)
            outlier.is_outlier(z, t0 + 3, o)
            out.off = d:get("le:z") == nil
            out.after = {liveness.suspect_after(hn, o) or false, liveness.EARLY_TIMEOUT_S}
            return out
    """, floor=5.0, stream_floor=5.0)
    assert got["at_0_9"] == [False, False]
    assert got["at_1_3"] == [False, pytest.approx(1000.2)]
    assert got["failed"] is True and got["flagged"] is True
    assert got["byte_since"] is False and got["answered_since"] is False
    assert got["by_name"] is True and got["off"] is True
    assert got["after"] == [False, 1]


def test_a_node_that_answered_a_check_just_before_it_froze_is_still_found(
        workdir: Path) -> None:
    """A check answered just after the request started (the node froze a moment later)
    is older than the early check that then got no answer: the node is found silent. The
    answer is compared with when that failed check began, not with the start of the
    silence it was made for (before, such a node was never found, and a stream waited on
    it for its whole read bound: 37-67 s on real engines)."""
    got = run(workdir, """
            local d = ngx.shared.infergate_stats
            local t0 = 1000
            local hn = {name = "h", scheme = "http", addr = "127.0.0.1", port = 9}
            for i = 1, 10 do answered("h", t0, 0.2, false) end      -- threshold: 5 s floor
            d:set("lb:h", t0 + 0.05)                                -- its last byte
            local att = stats.open_attempt("h", t0 + 0.1)
            outlier.track(att, false)
            d:set("la:h", t0 + 0.12)               -- answered a check, then froze
            local out = {}
            out.before = outlier.is_outlier(hn, t0 + 1.3)
            d:set("lx:h", t0 + 0.1)                -- the early check of that silence...
            d:set("lq:h", t0 + 1.3)                -- ...began after the answer: none came
            out.found = outlier.is_outlier(hn, t0 + 2.4)
            -- a request that is not a stream leaves it after a second failed check only
            out.gone_once = outlier.gone_silent(hn, att, t0 + 2.4)
            d:set("ly:h", t0 + 0.1)                -- a second check of that silence failed
            out.gone = outlier.gone_silent(hn, att, t0 + 3.4)
            d:set("la:h", t0 + 3.5)                -- it answers again: not silent
            d:delete("ol:h")
            d:delete("os:h")
            out.answered = outlier.is_outlier(hn, t0 + 3.6)
            return out
    """, floor=5.0, stream_floor=5.0)
    assert got == {"before": False, "found": True, "gone_once": False, "gone": True,
                   "answered": False}, got


def test_the_quiet_of_a_node_that_never_sent_a_byte_is_dated_once(workdir: Path) -> None:
    """Worker 0's tick asks early checks of a node with requests and no byte: for a node
    that never sent one (new, or the edge just started) every check is of one silence,
    dated from the first tick that saw it, so that a second failed check finds it frozen
    (before, each tick dated a silence of its own, and a plain request on such a node
    that froze waited for its deadline); once it sent a byte, the quiet is dated from it."""
    got = run(workdir, """
            package.loaded["infergate.routing.liveness"] = nil
            local ngxapi = require("infergate.core.ngxapi")
            local real, clock = ngxapi.now, 1000
            ngxapi.now = function() return clock end
            local lv = require("infergate.routing.liveness")
            ngxapi.now = real
            local d = ngx.shared.infergate_stats
            local hn = {name = "h", scheme = "http", addr = "127.0.0.1", port = 9}
            local o = config.get()
            local function tick()
                d:delete("le:h")                    -- the ask's own TTL has run out
                local timer_at = ngx.timer.at       -- no timers in init_by_lua: none started
                ngx.timer.at = function() return nil, "not here" end
                lv.tick({hn}, o, function() return 1.5 end, function() return 1 end)
                ngx.timer.at = timer_at
                return d:get("le:h") or false
            end
            local out = {tick()}
            clock = 1002.5
            out[2] = tick()
            d:set("lb:h", 1003)
            clock = 1004.5
            out[3] = tick()
            return out
    """)
    assert got == [pytest.approx(999.0), pytest.approx(999.0), pytest.approx(1003.0)], got


def test_a_request_not_streamed_that_asked_for_a_long_answer_is_waited_on(
        workdir: Path) -> None:
    """A request that is not a stream gets its first byte with its whole answer: one that
    asked for 400 tokens of a node that writes 0.05 s per token (an answer of 20 s, its
    bound twice that) is no sign of a hang at the 5 s threshold; past its own bound, or
    with no max_tokens and no learned length, the threshold holds as before."""
    got = run(workdir, """
            local learned = require("infergate.routing.learned")
            local t0 = 1000
            local out = {}
            for _, name in ipairs({"a", "b"}) do
                for i = 1, 10 do answered(name, t0, 0.2, false) end  -- threshold: 5 s floor
                for i = 1, 20 do learned.observe(name, 0.05 * (10 + i), 10 + i, t0) end
            end
            local a = {name = "a"}
            local att = stats.open_attempt("a", t0 + 1)
            outlier.track(att, false, {model = "m", body = {max_tokens = 400}})
            out.bound = learned.answer_bound_s("a", {body = {max_tokens = 400}}, t0)
            out.at_7 = outlier.is_outlier(a, t0 + 8)
            out.at_30 = outlier.is_outlier(a, t0 + 31)
            out.past = outlier.is_outlier(a, t0 + 42)
            local b = {name = "b"}
            local bt = stats.open_attempt("b", t0 + 1)
            outlier.track(bt, false, {model = "m", body = {}})
            out.no_max = outlier.is_outlier(b, t0 + 8)
            return out
    """, floor=5.0, stream_floor=5.0)
    assert got["bound"] == pytest.approx(40.0, rel=0.05)
    assert got["at_7"] is False and got["at_30"] is False and got["past"] is True
    assert got["no_max"] is True


def test_a_probe_of_a_node_that_froze_again_gives_up_at_a_failed_check(workdir: Path) -> None:
    """A half-open probe, sent after the node was found silent and answered the check
    that let it go, gives up once an early check begun after it was sent (and after the
    node's last byte) got no answer: one for a stream, two in a row for an answer not
    streamed (before, it waited its whole probe read bound, 13-17 s on real engines). Two
    failed checks are in a row when nothing came from the node between them, whichever
    silence each was dated from."""
    got = run(workdir, """
            local liveness = require("infergate.routing.liveness")
            local d = ngx.shared.infergate_stats
            local t0 = 1000
            local hn = {name = "h", scheme = "http", addr = "127.0.0.1", port = 9}
            for i = 1, 10 do answered("h", t0, 0.2, false) end     -- its last first byte: t0
            d:set("os:h", t0 + 1)                                  -- found silent
            d:set("la:h", t0 + 2)                                  -- answered: probes go
            local att = stats.open_attempt("h", t0 + 3)
            outlier.track(att, true)
            local pl = stats.open_attempt("h", t0 + 3)
            outlier.track(pl, false)
            local out = {}
            out.none = outlier.gone_silent(hn, att, t0 + 3.5)
            d:set("lx:h", t0)                                      -- an early check begun
            d:set("lq:h", t0 + 4)                                  -- after the probe: none
            out.stream = outlier.gone_silent(hn, att, t0 + 5)
            out.plain_once = outlier.gone_silent(hn, pl, t0 + 5)
            out.row = liveness._in_a_row(d, "h", t0 + 5.2)         -- the next one fails too
            d:set("ly:h", t0)
            out.plain_twice = outlier.gone_silent(hn, pl, t0 + 6.3)
            out.finding = d:get("os:h")
            d:set("lb:h", t0 + 4.5)                 -- a byte after that check began
            out.after_byte = outlier.gone_silent(hn, att, t0 + 6.5)
            out.row_after_byte = liveness._in_a_row(d, "h", t0 + 5.2)
            out.row_late = liveness._in_a_row(d, "h", t0 + 9)
            return out
    """, floor=5.0, stream_floor=5.0)
    assert got == {"none": False, "stream": True, "plain_once": False, "row": True,
                   "plain_twice": True, "finding": 1001, "after_byte": False,
                   "row_after_byte": False, "row_late": False}, got


def test_a_finding_right_after_a_failed_early_check_gets_the_early_timeout(
        workdir: Path) -> None:
    """The check of a finding made just after an early check got no answer (nothing from
    the node since) is the second of one silence: it waits the early check's 1 s, not
    the finding's own 3 s or more, so a request not streamed on a frozen node moves 1 s
    after the finding; otherwise, or with an answer or a byte since, the longer one."""
    got = run(workdir, """
            local liveness = require("infergate.routing.liveness")
            local d = ngx.shared.infergate_stats
            local t0 = 1000
            local out = {}
            out.none = liveness._finding_timeout(d, "h", t0, 1.5)
            d:set("fb:h", t0 - 5)
            d:set("lq:h", t0 - 1)                  -- an early check began 1 s before: none
            out.after_failed = liveness._finding_timeout(d, "h", t0, 1.5)
            out.long_after = liveness._finding_timeout(d, "h", t0 + 10, 1.5)
            d:set("lb:h", t0 - 0.5)                -- a byte since that check began
            out.byte_since = liveness._finding_timeout(d, "h", t0, 1.5)
            return out
    """)
    assert got == {"none": 3, "after_failed": 1, "long_after": 3, "byte_since": 3}, got
