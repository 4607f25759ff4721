"""Stall detection in the edge's pure logic (infergate.routing.stall, asked by
infergate.routing.outlier.is_outlier): a node with streams in the middle of their answer
and no byte past max(stall_min_s, stall_gap_factor x p90 of its largest gaps) gets no new
request, a byte clears it, a node found stalled is half-open with a probe backoff, and
waiting for a first byte or a whole non-streamed answer is not a stall. Run in nginx's
init_by_lua with real shared dicts and explicit clocks (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def run(workdir: Path, body: str, factor: float = 4.0, floor: float = 1.0):
    prelude = """
            local config = require("infergate.core.config")
            assert(config.init({edge = {stall_gap_factor = """ + str(factor) + """,
                                        stall_min_s = """ + str(floor) + """,
                                        outlier_ttfb_factor = 0}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local stall = require("infergate.routing.stall")
            local outlier = require("infergate.routing.outlier")
            local stats = require("infergate.routing.stats")
            local d = ngx.shared.infergate_stats
            local node = {name = "n"}
            local function req_on(name, t, stream)
                local att = stats.open_attempt(name, t)
                return {attempts = {att}, stream = stream}, att
            end
            local function ended(req, att, t)
                stats.close_attempt(att, "ok", t)
                outlier.finished(att, t)
            end
            -- a streamed answer on `name` from t: chunks `gap` s apart, `n` of them
            local function streamed(name, t, gap, n)
                local req, att = req_on(name, t, true)
                for k = 1, n do stall.byte(req, t + k * gap) end
                ended(req, att, t + n * gap)
                return t + n * gap
            end
            -- a streamed answer on `name` from t, paused `gap` s after its first chunk
            -- (`during(t)`, if any, runs in the pause); returns t + 5
            local function paused(name, t, gap, during)
                local req, att = req_on(name, t, true)
                stall.byte(req, t + 0.1)
                if during then during(t) end
                stall.byte(req, t + 0.1 + gap)
                ended(req, att, t + 0.1 + gap)
                return t + 5
            end
            local function blocked(t)
                return outlier.is_outlier(node, t)
            end
            -- `nd` found stalled mid-stream (at t0 + 1.5), then its stream ended and the
            -- flag expired: half-open; returns what is_outlier said at the finding
            local function found_then_idle(nd, t0)
                local req, att = req_on(nd.name, t0, true)
                stall.byte(req, t0 + 0.1)
                local found = outlier.is_outlier(nd, t0 + 1.5)
                stats.close_attempt(att, "neutral", t0 + 1.6)
                outlier.finished(att, t0 + 1.6)
                d:delete("sl:" .. nd.name)
                return found
            end
"""
    return lua_eval(workdir, prelude + body, http_extra=DICTS)


def test_threshold_is_the_floor_or_factor_times_the_p90_gap(workdir: Path) -> None:
    got = run(workdir, """
            local out = {none = stall.threshold("n")}
            local t = 1000
            for i = 1, 10 do t = streamed("n", t + 1, 0.05 * i, 3) end   -- gaps 0.05..0.5
            out.p90 = d:get("gq:n")
            out.thr = stall.threshold("n")
            for i = 1, 30 do t = streamed("n", t + 1, 0.02, 3) end       -- the ring forgets
            out.thr_after = stall.threshold("n")
            -- non-streamed answers add no gap sample
            local req, att = req_on("m", t, false)
            stall.byte(req, t + 0.1); stall.byte(req, t + 3)
            ended(req, att, t + 3)
            out.plain = d:get("gq:m") or false
            return out
    """)
    assert got["none"] == 1.0
    assert got["p90"] == pytest.approx(0.4)             # 18th of the 10 gaps and 10 zeros
    assert got["thr"] == pytest.approx(1.6)            # 4 x p90
    assert got["thr_after"] == 1.0                     # 4 x 0.02 below the floor
    assert got["plain"] is False


def test_a_node_silent_mid_stream_is_stalled_until_a_byte_comes(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local t0 = 1000
            local req, att = req_on("n", t0, true)
            stall.byte(req, t0 + 0.2)                    -- first chunk: mid-stream
            stall.byte(req, t0 + 0.3)
            out.early = blocked(t0 + 1.2)                -- silent 0.9 s < 1 s floor
            out.late = blocked(t0 + 1.5)                 -- silent 1.2 s
            out.flagged = stall.flagged("n")
            out.report = stats.node_report("n", t0 + 1.5).stalled
            out.other = outlier.is_outlier({name = "m"}, t0 + 100)
            stall.byte(req, t0 + 2.0)                    -- it resumes
            out.after_byte = blocked(t0 + 2.05)
            out.flag_after_byte = stall.flagged("n")
            out.again = blocked(t0 + 3.5)                -- silent again past the floor
            ended(req, att, t0 + 4)
            out.one_answer = d:get("gq:n")      -- one 1.7 s gap: the prior's zeros outweigh it
            return out
    """)
    assert got["early"] is False and got["late"] is True
    assert got["flagged"] is True and got["report"] is True
    assert got["other"] is False
    assert got["after_byte"] is False and got["flag_after_byte"] is False
    assert got["again"] is True
    assert got["one_answer"] == 0


def test_waiting_for_a_first_byte_or_a_whole_answer_is_not_a_stall(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local t0 = 1000
            local s_req = req_on("n", t0, true)          -- a stream, no chunk yet
            local p_req, p_att = req_on("n", t0, false)  -- a non-streamed answer
            out.waiting = blocked(t0 + 30)
            stall.byte(p_req, t0 + 31)                   -- the whole answer at once
            stall.byte(p_req, t0 + 31.01)
            out.plain_answered = blocked(t0 + 60)
            ended(p_req, p_att, t0 + 31.02)
            return out
    """)
    assert got == {"waiting": False, "plain_answered": False}


def test_the_flag_holds_for_other_workers_and_a_stalled_node_is_half_open(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local t0 = 1000
            local req, att = req_on("n", t0, true)
            stall.byte(req, t0 + 0.1)
            out.found = blocked(t0 + 1.5)
            -- its stream ends (the deadline): no stream left in this worker, the flag
            -- (as another worker sees it) still holds
            stats.close_attempt(att, "neutral", t0 + 1.6)
            outlier.finished(att, t0 + 1.6)
            out.flag = blocked(t0 + 1.7)
            -- the flag expired, no byte since: one request at a time
            d:delete("sl:n")
            out.probe_allowed = blocked(t0 + 10)
            out.probe_read = outlier.probe_threshold("n", false)
            local preq, patt = req_on("n", t0 + 10, true)
            out.during_probe = blocked(t0 + 10.5)
            -- the probe waited past the threshold, no byte: backoff 1 x 2^1 s
            stats.close_attempt(patt, "fail", t0 + 12)
            outlier.finished(patt, t0 + 12)
            out.backoff = blocked(t0 + 13)
            out.after_backoff = blocked(t0 + 14.1)
            -- a probe that answers ends it all
            local ok_req, ok_att = req_on("n", t0 + 15, true)
            stall.byte(ok_req, t0 + 15.2)
            ended(ok_req, ok_att, t0 + 15.3)
            out.resumed = blocked(t0 + 15.4)
            out.no_probe_read = outlier.probe_threshold("n", false) or false
            out.flagged = stall.flagged("n")
            return out
    """)
    assert got["found"] is True and got["flag"] is True
    assert got["probe_allowed"] is False
    assert got["probe_read"] == pytest.approx(5.0)   # outlier_ttfb_min_s, above the stall 1 s
    assert got["during_probe"] is True
    assert got["backoff"] is True and got["after_backoff"] is False
    assert got["resumed"] is False and got["no_probe_read"] is False and got["flagged"] is False


def test_a_stall_leaves_what_the_edge_learned_of_the_node_and_backs_probes_off_in_turn(
        workdir: Path) -> None:
    """The stall's own records live beside the node's learned figures in one shared
    dict: finding a node stalled and seeing it resume keeps its learned concurrency and
    service time, and unanswered probes back it off for twice as long each time while
    those figures are there."""
    got = run(workdir, """
            local out = {}
            local speed = require("infergate.routing.speed")
            local t0 = 1000
            for _ = 1, 20 do
                speed.observe({node = "n", k = 1}, 1000); speed.observe({node = "n", k = 3}, 3000)
            end
            out.before = speed.learned("n")
            found_then_idle(node, t0)
            local function probe(at, ends)
                local preq, patt = req_on("n", at, true)
                stats.close_attempt(patt, "fail", ends)
                outlier.finished(patt, ends)
            end
            probe(t0 + 10, t0 + 12)                      -- backoff 1 x 2^1 s
            out.first = d:get("su:n") - (t0 + 12)
            probe(t0 + 14.1, t0 + 16)                    -- then 1 x 2^2 s
            out.second = d:get("su:n") - (t0 + 16)
            local req, att = req_on("n", t0 + 20.1, true)
            stall.byte(req, t0 + 20.2)                   -- it resumes
            ended(req, att, t0 + 20.3)
            out.after = speed.learned("n")
            return out
    """)
    assert got["before"] == pytest.approx(1.0, abs=0.05)
    assert got["first"] == pytest.approx(2.0) and got["second"] == pytest.approx(4.0)
    assert got["after"] == pytest.approx(got["before"])


def test_a_larger_usual_gap_raises_the_bar(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local t = 1000
            for i = 1, 10 do t = streamed("n", t + 1, 0.8, 3) end     -- p90 0.8: thr 3.2 s
            local req = req_on("n", t + 1, true)
            stall.byte(req, t + 1.1)
            out.at_2s = blocked(t + 3.1)
            out.at_3_5s = blocked(t + 4.7)
            return out
    """)
    assert got == {"at_2s": False, "at_3_5s": True}


def test_one_long_pause_of_a_new_node_does_not_raise_its_threshold(workdir: Path) -> None:
    """The prior: answers not seen yet count as gaps of 0, so the first long pause of a
    node (one no liveness check caught: shorter than the check's wait) leaves its
    threshold at the floor; the third such pause in its last 20 answers raises it."""
    got = run(workdir, """
            local out = {}
            local t = 1000
            for k = 1, 3 do
                t = paused("n", t, 1.6)
                out[k] = stall.threshold("n")
            end
            return out
    """)
    assert got[:2] == [1.0, 1.0]
    assert got[2] == pytest.approx(6.4)                  # 4 x 1.6


def test_a_freeze_the_node_resumed_from_is_not_one_of_its_gaps(workdir: Path) -> None:
    """A gap in which an early liveness check of the node got no answer (SIGSTOP, then
    SIGCONT: its streams resume) is left out of the gap figures: each freeze survived
    would otherwise raise the threshold (factor 4 x a gap of up to twice the threshold),
    and the next freeze would be found later and later. A pause the node answered a check
    in (a long prefill) still counts."""
    got = run(workdir, """
            local out = {}
            local t = 1000
            for _ = 1, 10 do                          -- a check began, never answered
                t = paused("n", t, 2.5, function(at) d:set("lq:n", at + 1.1) end)
            end
            out.frozen = stall.threshold("n")
            for _ = 1, 10 do                          -- ... and then one was answered
                t = paused("p", t, 2.5, function(at)
                    d:set("lq:p", at + 1.1)
                    d:set("la:p", at + 1.5)
                end)
            end
            out.paused = stall.threshold("p")
            return out
    """)
    assert got["frozen"] == pytest.approx(1.0)          # the floor: 4 x 0.1
    assert got["paused"] == pytest.approx(10.0)         # 4 x 2.5


def test_a_freeze_shorter_than_the_checks_timeout_is_not_one_of_its_gaps(workdir: Path) -> None:
    """A SIGSTOP of 1.6 s: the early check begun at 1 s of quiet gets its answer only
    when the node resumes. Answered after liveness.LATE_S, it was frozen, not paused:
    that gap is left out too; a check answered at once leaves the gap counted."""
    got = run(workdir, """
            local out = {}
            local t = 1000
            for _, late in ipairs({true, false}) do
                local name = late and "z" or "q"
                for _ = 1, 10 do
                    t = paused(name, t, 1.6, function(at)
                        if late then d:set("lz:" .. name, at + 1.1) end   -- answered at 1.7
                        d:set("la:" .. name, at + 1.7)
                    end)
                end
            end
            out.late = stall.threshold("z")
            out.prompt = stall.threshold("q")
            return out
    """)
    assert got["late"] == pytest.approx(1.0)
    assert got["prompt"] == pytest.approx(6.4)          # 4 x 1.6


def test_a_check_that_failed_after_the_streams_last_byte_ends_its_wait(workdir: Path) -> None:
    """liveness.mid_stream: "dead" when an early check that began after the stream's last
    byte got no answer, though the silence it was asked for began a little before that
    byte (the node's last-byte time is written every 0.1 s); "alive" only for a recent
    answer; "pending" otherwise."""
    got = run(workdir, """
            local liveness = require("infergate.routing.liveness")
            local nd = {name = "m", scheme = "http", addr = "127.0.0.1", port = 9}
            local out = {}
            d:set("lx:m", 1000.0)                    -- the check's silence: since 1000.0
            d:set("lq:m", 1001.0)                    -- it began at 1001.0, no answer
            out.dead = liveness.mid_stream(nd, 1000.08, nil, 1000.08)
            d:set("la:m", 1001.5)                    -- a later check answered
            out.alive = liveness.mid_stream(nd, 1000.08, nil, 1000.08)
            out.stale = liveness.mid_stream(nd, 1000.08, nil, 1003.0)
            return out
    """)
    assert got == {"dead": "dead", "alive": "alive", "stale": "pending"}


def test_factor_zero_turns_it_off(workdir: Path) -> None:
    got = run(workdir, """
            local req = req_on("n", 1000, true)
            stall.byte(req, 1000.1)
            return {blocked(1100), stall.flagged("n")}
    """, factor=0)
    assert got == [False, False]


def test_a_stream_try_reads_with_the_first_byte_bound(workdir: Path) -> None:
    """A stream try with another node to retry on waits at most max(stall_first_byte_s,
    2 x its TTFB outlier threshold, 2 x its stall threshold) (probe_read doubles the
    half returned); a non-streamed one keeps the deadline's read timeout."""
    got = run(workdir, """
            local out = {}
            out.stream = outlier.probe_threshold("x", true)            -- max(10, 2 x 5)/2
            out.plain = outlier.probe_threshold("x", false) or false
            local t = 1000
            for i = 1, 10 do t = streamed("g", t + 1, 4.0, 3) end     -- usual gap 4 s
            out.slow_gaps = outlier.probe_threshold("g", true)        -- 2 x 4 x 4 / 2
            return out
    """)
    assert got == {"stream": 5.0, "plain": False, "slow_gaps": pytest.approx(16.0)}
    off = run(workdir, """
            return outlier.probe_threshold("x", true) or false
    """, factor=0)
    assert off is False


def test_a_stream_count_left_behind_cannot_make_an_idle_node_stalled(workdir: Path) -> None:
    got = run(workdir, """
            local req, att = req_on("n", 1000, true)
            stall.byte(req, 1000.1)
            stats.close_attempt(att, "ok", 1000.2)     -- ended without finished()
            return {blocked(1010), stall.flagged("n", 0)}
    """)
    assert got == [False, False]


def test_a_silent_node_gets_no_probe_before_it_answers_a_liveness_check(workdir: Path) -> None:
    """infergate.routing.liveness: a plain http node found stalled gets its half-open
    probe only once it answered a check made after the finding, or HOLD_MAX_S after it;
    https nodes and nodes without an IP are never held."""
    got = run(workdir, """
            local liveness = require("infergate.routing.liveness")
            local out = {}
            local t0 = 1000
            local hn = {name = "n", scheme = "http", addr = "127.0.0.1", port = 9}
            out.found = found_then_idle(hn, t0)
            out.held = outlier.is_outlier(hn, t0 + 10)
            out.wanted = d:get("lw:n") == d:get("ss:n")
            out.tls = outlier.is_outlier({name = "n", scheme = "https", addr = "127.0.0.1",
                                          port = 9}, t0 + 10)
            out.by_name = outlier.is_outlier({name = "n", scheme = "http", port = 9}, t0 + 10)
            d:set("la:n", d:get("ss:n") - 1)              -- an answer from before the finding
            out.old_answer = outlier.is_outlier(hn, t0 + 10)
            out.past_hold = outlier.is_outlier(hn, d:get("ss:n") + liveness.HOLD_MAX_S + 1)
            d:set("la:n", t0 + 9)                         -- answered after the finding
            out.answered = outlier.is_outlier(hn, t0 + 10)
            out.timeouts = {liveness.timeout(0.2), liveness.timeout(1.5), liveness.timeout(40)}
            return out
    """)
    assert got["found"] is True and got["held"] is True and got["wanted"] is True
    assert got["tls"] is False and got["by_name"] is False
    assert got["old_answer"] is True and got["past_hold"] is False
    assert got["answered"] is False
    assert got["timeouts"] == [3, 3, 10]


def test_a_request_waiting_on_a_silent_node_gives_up_only_on_a_failed_liveness_check(
        workdir: Path) -> None:
    """infergate.routing.outlier.gone_silent: found stalled after the attempt started and
    silent since is not enough; a liveness check made for that finding must have got no
    answer (and none since). A probe sent after the finding is never cut."""
    got = run(workdir, """
            local out = {}
            local t0 = 1000
            local hn = {name = "n", scheme = "http", addr = "127.0.0.1", port = 9}
            local req, att = req_on("n", t0, true)
            stall.byte(req, t0 + 0.1)
            local _, waiting = req_on("n", t0 + 0.2, true)     -- no byte yet
            out.before = outlier.gone_silent(hn, waiting, t0 + 0.5)
            out.found_no_check = outlier.gone_silent(hn, waiting, t0 + 1.5)
            local ss = d:get("ss:n")
            d:set("ln:n", ss)                                   -- the check got no answer
            out.check_failed = outlier.gone_silent(hn, waiting, t0 + 2)
            out.tls = outlier.gone_silent({name = "n", scheme = "https", addr = "127.0.0.1",
                                           port = 9}, waiting, t0 + 2)
            local _, probe = req_on("n", ss + 0.5, true)        -- sent after the finding
            out.probe = outlier.gone_silent(hn, probe, ss + 1)
            d:set("la:n", ss + 0.1)                             -- then it answered one
            out.answered = outlier.gone_silent(hn, waiting, t0 + 2.5)
            return out
    """)
    assert got == {"before": False, "found_no_check": False, "check_failed": True,
                   "tls": False, "probe": False, "answered": False}


def test_a_breaker_probe_waits_for_the_liveness_check_of_a_silent_node(workdir: Path) -> None:
    """infergate.routing.candidates.gather: a node whose breaker is ready for its probe
    and that was found silent without answering a liveness check since gets no probe
    (its flags may have cleared: no request of this edge is left on it); once it
    answers a check, the probe goes."""
    got = run(workdir, """
            local candidates = require("infergate.routing.candidates")
            local out = {}
            local t0 = 1000
            local hn = {name = "n", scheme = "http", addr = "127.0.0.1", port = 9,
                        healthy = true, state = "active", effective_weight = 1}
            local t = {nodes = {hn}}
            out.found = found_then_idle(hn, t0)
            d:set("bo:n", t0)                      -- the breaker opened, its cooldown over
            local _, _, _, probe = candidates.gather(t, {}, t0 + 20, false, nil, config.get())
            out.probe_while_silent = probe ~= nil
            d:set("la:n", t0 + 50)                 -- it answered a check
            _, _, _, probe = candidates.gather(t, {}, t0 + 20, false, nil, config.get())
            out.probe_after_answer = probe ~= nil
            return out
    """)
    assert got == {"found": True, "probe_while_silent": False, "probe_after_answer": True}


def test_a_leg_gives_up_early_only_with_another_node_left(workdir: Path) -> None:
    """infergate.routing.relaypick.other_left, asked by a stream leg before it gives up
    waiting for a node's head: true only while an untried node with a closed breaker is
    left (a half-open or open breaker takes no retry); and the leg's socket timeouts are
    whole milliseconds, never 0 (which would mean lua_socket_read_timeout)."""
    got = run(workdir, """
            local relaypick = require("infergate.routing.relaypick")
            local leg = require("infergate.stream.leg")
            local function hn(name)
                return {name = name, scheme = "http", addr = "127.0.0.1", port = 9,
                        healthy = true, state = "active", weight = 1, effective_weight = 1}
            end
            local t = {nodes = {hn("a"), hn("b")}}
            local now = 1000
            local out = {}
            out.untried = relaypick.other_left({tried = {a = true}}, now, t)
            out.all_tried = relaypick.other_left({tried = {a = true, b = true}}, now, t)
            d:set("bo:b", now - 1)                       -- b's breaker just opened
            out.open = relaypick.other_left({tried = {a = true}}, now, t)
            out.half_open = relaypick.other_left({tried = {a = true}}, now + 3600, t)
            out.ms = {leg.ms(0.0004), leg.ms(0.3456), leg.ms(0), leg.ms(2)}
            return out
    """)
    assert got == {"untried": True, "all_tried": False, "open": False, "half_open": False,
                   "ms": [1, 346, 1, 2000]}
