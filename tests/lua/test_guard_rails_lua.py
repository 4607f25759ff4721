"""Guard rails of the learned parts of the scheduler: the shared arithmetic
(infergate.routing.guard), the per-model output-length quantile (infergate.routing.lengths)
and how the answer-time tail uses it (infergate.routing.learned), the yield when answers
come far sooner than predicted, and the TTFB baseline's prior, floor, ceiling and decay
(infergate.routing.outlier); run in nginx's init_by_lua with real shared dicts and
explicit clocks (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def run(workdir: Path, body: str):
    prelude = """
            local config = require("infergate.core.config")
            assert(config.init({edge = {outlier_ttfb_factor = 4, outlier_ttfb_min_s = 2,
                                        outlier_stream_ttfb_min_s = 0.5}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local guard = require("infergate.routing.guard")
            local lengths = require("infergate.routing.lengths")
            local learned = require("infergate.routing.learned")
            local outlier = require("infergate.routing.outlier")
            local stats = require("infergate.routing.stats")
            local out = {}
"""
    return lua_eval(workdir, prelude + body, http_extra=DICTS)


def test_guard_arithmetic(workdir: Path) -> None:
    got = run(workdir, """
            out.fresh = guard.decay(10, 2, 5, 10, 20)          -- not stale yet: as learned
            out.half = guard.decay(10, 2, 30, 10, 20)          -- one half-life past stale
            out.gone = guard.decay(10, 2, 10 + 20 * 40, 10, 20)
            out.w0 = guard.weight(nil, 10, 20)
            out.clamp = {guard.clamp(5, 1, 3), guard.clamp(0, 1, 3), guard.clamp(2, 1, 3)}
            -- a run of 8 answers far below q: q becomes the largest of them at once
            local q, run, top = 100, 0, 0
            for i = 1, 7 do q, run, top = guard.yield(q, 10 + i, run, top, 4, 8) end
            out.before = q
            q, run, top = guard.yield(q, 5, run, top, 4, 8)
            out.after, out.run = q, run
            -- one answer near q breaks the run
            local q2, r2, t2 = 100, 0, 0
            for i = 1, 7 do q2, r2, t2 = guard.yield(q2, 10, r2, t2, 4, 8) end
            q2, r2, t2 = guard.yield(q2, 90, r2, t2, 4, 8)
            q2, r2, t2 = guard.yield(q2, 10, r2, t2, 4, 8)
            out.broken = {q2, r2}
            return out
    """)
    assert got["fresh"] == 10
    assert got["half"] == pytest.approx(6)
    assert got["gone"] == pytest.approx(2)
    assert got["w0"] == 1
    assert got["clamp"] == [3, 1, 2]
    assert got["before"] == 100
    assert got["after"] == 17 and got["run"] == 0
    assert got["broken"] == [100, 1]


def test_output_length_quantile_prior_bounds_yield_and_decay(workdir: Path) -> None:
    got = run(workdir, """
            local now = 1000
            out.none = {lengths.quantile("m", now)}             -- no record: no weight
            lengths.observe("m", 0, now)                         -- not a length: ignored
            out.still_none = lengths.info("m") == nil
            for i = 1, 600 do lengths.observe("m", (i % 10 == 0) and 200 or 20, now) end
            out.q, out.w = lengths.quantile("m", now)
            out.other = lengths.info("other") == nil             -- per model
            out.top = lengths.info("m").top
            out.w_stale = select(2, lengths.quantile("m", now + lengths.STALE_S))
            out.w_half = select(2, lengths.quantile("m", now + lengths.STALE_S
                                                    + lengths.HALF_LIFE_S))
            -- the model now answers in 2-3 tokens: the quantile yields after a run of 8
            for i = 1, 7 do lengths.observe("m", 2 + i % 2, now) end
            out.q7 = lengths.info("m").q
            lengths.observe("m", 2, now)
            out.q8 = lengths.info("m").q
            -- one huge answer cannot lift the quantile past the largest seen
            lengths.observe("x", 5, now)
            for _ = 1, 200 do lengths.observe("x", 5, now) end
            out.x = lengths.info("x").q
            return out
    """)
    assert got["none"] == [None, 0]
    assert got["still_none"] and got["other"]
    assert 20 < got["q"] <= 200 and got["w"] == 1
    assert got["top"] == 200
    assert got["w_stale"] == 1 and got["w_half"] == pytest.approx(0.5)
    assert got["q7"] > 20
    assert got["q8"] == 3
    assert got["x"] == pytest.approx(5)


def test_tail_uses_the_models_length_and_yields_to_answers_far_sooner(workdir: Path) -> None:
    got = run(workdir, """
            local now = 1000
            -- node "a": answers of 100 tokens take 1 s, one in five of 500 tokens 5 s
            for i = 1, 400 do
                if i % 5 == 0 then learned.observe("a", 5.0, 500, now)
                else learned.observe("a", 1.0, 100, now) end
            end
            out.plain = learned.tail_s("a", 1.4, {model = "m"}, now)
            -- model "m" answers 100 tokens: its requests need about 1 s, not the tail
            for _ = 1, 50 do lengths.observe("m", 100, now) end
            out.short = learned.tail_s("a", 1.4, {model = "m"}, now)
            out.short_small_mean = learned.tail_s("a", 0.5, {model = "m"}, now)
            -- model "long" answers 500 tokens: never more than the node's own tail
            for _ = 1, 50 do lengths.observe("long", 500, now) end
            out.long = learned.tail_s("a", 1.4, {model = "long"}, now)
            -- the length goes stale: back to the node's tail (itself back at its prior,
            -- 2 x the mean, after that long)
            local later = now + lengths.STALE_S + 40 * lengths.HALF_LIFE_S
            out.stale = learned.tail_s("a", 1.4, {model = "m"}, later)
            -- node "b": learned 8 s answers, then 1 s ones: the tail falls with the mean
            for _ = 1, 50 do learned.observe("b", 8.0, nil, now) end
            out.b_before = learned.tail_s("b", learned.info("b").m, nil, now)
            for _ = 1, 8 do learned.observe("b", 1.0, nil, now) end
            out.b_mean = learned.info("b").m
            out.b_after = learned.tail_s("b", learned.info("b").m, nil, now)
            return out
    """)
    assert 4.0 < got["plain"] < 5.5                  # the node's 0.9 quantile, near 5 s
    assert got["short"] == pytest.approx(1.4)        # 1 s fitted, not below the mean
    assert got["short_small_mean"] == pytest.approx(1.0, rel=0.05)
    assert got["long"] == pytest.approx(got["plain"])  # 5 s fitted: the tail stands
    assert got["stale"] == pytest.approx(2.8, rel=0.01)
    assert got["b_before"] >= 8.0
    assert got["b_mean"] < 1.5 and got["b_after"] < 2 * got["b_mean"]


def test_ttfb_baseline_has_a_prior_floor_ceiling_and_decay(workdir: Path) -> None:
    got = run(workdir, """
            local function answered(name, ttfb, stream)
                local now = ngx.now()
                local att = stats.open_attempt(name, now - ttfb)
                outlier.track(att, stream)
                outlier.first_byte({attempts = {att}}, now)
                stats.close_attempt(att, "ok", now)
            end
            local now = ngx.now()
            out.prior = outlier.threshold("n", true, nil, now)
            for _ = 1, 20 do answered("n", 0.01, true) end
            out.floor = outlier.threshold("n", true, nil, now)
            for _ = 1, 20 do answered("s", 30, true) end           -- a very slow spell
            out.ceiling = outlier.threshold("s", true, nil, now)
            out.s_stale = outlier.threshold("s", true, nil, now + outlier.STALE_S)
            out.s_decayed = outlier.threshold("s", true, nil,
                                              now + outlier.STALE_S + 40 * outlier.HALF_LIFE_S)
            return out
    """)
    assert got["prior"] == 2                       # no history: outlier_ttfb_min_s
    assert got["floor"] == pytest.approx(0.5)      # 4 x 0.01 s, raised to the stream floor
    assert got["ceiling"] == pytest.approx(24)     # 4 x 30 s, capped at 12 x the prior
    assert got["s_stale"] == pytest.approx(24)
    assert got["s_decayed"] == pytest.approx(2, rel=0.01)


def test_room_is_what_the_node_was_seen_running_while_others_waited(workdir: Path) -> None:
    from support.stack import lua_node_helpers

    got = run(workdir, lua_node_helpers(max_concurrency=8, score=0.1) + """
            local room = require("infergate.routing.room")
            local now = ngx.now()
            local a = node("a")
            out.prior = room.batch(a)                 -- nothing learned or seen: the prior
            a.running, a.queue_depth = 4, 0
            out.no_queue = room.batch(a)              -- running without a queue says nothing
            a.queue_depth = 3
            out.seen = room.batch(a)                  -- 4 running while 3 wait: it runs 4
            a.running, a.queue_depth = 2, 1
            out.kept = room.batch(a)                  -- 2 while 1 waits: still 4
            for _ = 1, 4 do stats.open_attempt("a", now) end
            local b = node("b")
            out.full = room.full({a, b}, 2)           -- a full, b has room: pass a over
            for _ = 1, 8 do stats.open_attempt("b", now) end
            out.none = room.full({a, b}, 2) == nil    -- neither has room: no preference
            return out
    """)
    assert got["prior"] == 8 and got["no_queue"] == 8
    assert got["seen"] == 4 and got["kept"] == 4
    assert got["full"] == [True]
    assert got["none"] is True


def test_a_models_length_record_and_a_node_of_the_same_name_do_not_collide(workdir: Path) -> None:
    got = run(workdir, """
            lengths.observe("static", 20, 1000)                  -- model "static"
            local ok, res = pcall(outlier.is_outlier, {name = "static"}, 1000)  -- node "static"
            out.ok, out.res = ok, res
            out.q = lengths.quantile("static", 1000)
            return out
    """)
    assert got["ok"] is True and got["res"] is False, got
    assert got["q"] == 20


def test_prompt_ratio_has_a_prior_floor_ceiling_and_stays_per_key(workdir: Path) -> None:
    """infergate.admission.promptratio: the rate limiter's prompt estimate is multiplied
    by the prompt tokens billed per estimated token, learned per key and model: 1 until
    MIN_OBS answers, never below 1 (the configured chars_per_token), at most CEIL, the
    mean of the first answers (not the first one alone), and only from a 2xx with the
    node's own usage."""
    got = run(workdir, """
            local pr = require("infergate.admission.promptratio")
            local a = {key_id = "ka", model = "m"}
            local b = {key_id = "kb", model = "m"}
            out.prior = pr.factor(a)
            pr.observe(a, 40, 10)
            pr.observe(a, 44, 10)
            out.few = pr.factor(a)                              -- 2 answers: still the prior
            pr.observe(a, 36, 10)
            out.learned = pr.factor(a)                          -- (40 + 44 + 36) / 30
            out.other_key = pr.factor(b)                        -- another tenant: untouched
            out.other_model = pr.factor({key_id = "ka", model = "n"})
            for _ = 1, 3 do pr.observe(b, 5, 10) end            -- billed fewer than estimated
            out.floor = pr.factor(b)
            local c = {key_id = "kc", model = "m"}
            for _ = 1, 3 do pr.observe(c, 1000, 10) end
            out.ceil = pr.factor(c)
            -- the log hook: a 429, a refused request and an estimated usage teach nothing
            local d = {key_id = "kd", model = "m", est_raw = 10}
            for _ = 1, 3 do
                d.usage = {prompt_tokens = 40}
                pr.log(d, 429)
                d.usage = {prompt_tokens = 40, estimated = true}
                pr.log(d, 200)
            end
            out.ignored = pr.factor(d)
            d.usage = {prompt_tokens = 40}
            for _ = 1, 3 do pr.log(d, 200) end
            out.logged = pr.factor(d)
            return out
    """)
    assert got["prior"] == 1 and got["few"] == 1
    assert got["learned"] == pytest.approx(4.0)
    assert got["other_key"] == 1 and got["other_model"] == 1
    assert got["floor"] == 1
    assert got["ceil"] == 8
    assert got["ignored"] == 1 and got["logged"] == pytest.approx(4.0)


def test_prompt_ratio_of_short_prompts_is_not_stretched_to_long_ones(workdir: Path) -> None:
    """infergate.admission.promptratio.scale: short chat messages bill mostly their
    template's fixed tokens (a gemma 3 llama-server: 27 tokens for 13 characters,
    estimated 4); their ratio (capped at 8) applies up to SPAN times the learned mean
    estimate, the rest of a far longer prompt at 1: three greetings no longer make the
    key's next 8,000-character prompt (2,000 estimated, 1,629 billed) cost 16,000."""
    got = run(workdir, """
            local pr = require("infergate.admission.promptratio")
            local a = {key_id = "ka", model = "m"}
            out.prior = pr.scale(a, 2000)
            for _ = 1, 3 do pr.observe(a, 27, 4) end
            out.short = pr.scale(a, 4)
            out.long = pr.scale(a, 2000)
            local z = {key_id = "kz", model = "m"}               -- Chinese: ~1 token a char
            for _ = 1, 3 do pr.observe(z, 4000, 1000) end
            out.zh = pr.scale(z, 1000)
            out.zh_long = pr.scale(z, 4000)
            return out
    """)
    assert got["prior"] == 2000
    assert got["short"] == 27
    assert got["long"] == 16 * 27 // 4 + 2000 - 16, got
    assert got["zh"] == 4000 and got["zh_long"] == 16000


def test_answers_cut_by_max_tokens_never_teach_shorter_lengths(workdir: Path) -> None:
    """infergate.routing.lengths: an answer cut by its max_tokens is a lower bound on
    what the model would have written. A flood of 1-token answers asked as such (a
    classifier) starts no record and leaves a learned quantile as it was; a cut answer
    longer than the quantile still raises it. Uncut short answers still pull it down."""
    got = run(workdir, """
            local now = ngx.now()
            for _ = 1, 50 do lengths.observe("c", 1, now, true) end
            out.none = lengths.info("c") == nil
            for _ = 1, 40 do lengths.observe("m", 100, now) end
            local q0 = lengths.info("m").q
            for _ = 1, 200 do lengths.observe("m", 1, now, true) end
            out.kept = lengths.info("m").q / q0
            lengths.observe("m", 400, now, true)
            out.raised = lengths.info("m").q > q0
            for _ = 1, 8 do lengths.observe("m", 1, now) end
            out.uncut = lengths.info("m").q
            return out
    """)
    assert got["none"] is True
    assert got["kept"] == pytest.approx(1.0)
    assert got["raised"] is True
    assert got["uncut"] == pytest.approx(1.0)


def test_length_ratio_is_against_the_mean_length_on_the_nodes_own_line(
        workdir: Path) -> None:
    got = run(workdir, """
            local now = 1000
            out.before = learned.length_ratio("a", 100)       -- nothing learned yet
            -- "a" answers in 0.2 s + 10 ms a token, "slow" in twice that; lengths 20-100
            for i = 1, 400 do
                local t = 20 + (i % 5) * 20
                learned.observe("a", 0.2 + 0.01 * t, t, now)
                learned.observe("slow", 2 * (0.2 + 0.01 * t), t, now)
            end
            out.short = learned.length_ratio("a", 20)
            out.long = learned.length_ratio("a", 100)
            out.slow_long = learned.length_ratio("slow", 100)
            out.huge = learned.length_ratio("a", 100000)
            out.unknown_tokens = learned.length_ratio("a", nil)
            out.zero_tokens = learned.length_ratio("a", 0)
            out.unknown_node = learned.length_ratio("b", 100)
            return out
    """)
    for unknown in ("before", "unknown_tokens", "zero_tokens", "unknown_node"):
        assert unknown not in got
    # the mean length is about 60 tokens: 0.4 s and 1.2 s against 0.8 s
    assert got["short"] == pytest.approx(0.4 / 0.8, rel=0.05)
    assert got["long"] == pytest.approx(1.2 / 0.8, rel=0.05)
    assert got["slow_long"] == pytest.approx(got["long"], rel=1e-6)  # its line, its speed
    assert got["huge"] == pytest.approx(16)                             # RATIO_MAX
