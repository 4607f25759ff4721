"""The pure parts of the prefix-cache scenarios (bench/scheduler/sessions.py and
prefix.py): the session workload, its sizing, and the statistics of a run."""

from __future__ import annotations

import random

import pytest

from bench.scheduler import prefix, sessions
from bench.scheduler.sessions import (BLOCK_TOKENS, CHARS_PER_TOKEN, SessionSpec, TurnResult,
                                      build_sessions, hit_rate, inflight_stats,
                                      parse_prefix_counters, request_shares, session_rate,
                                      start_times, state_prefix_counters, text_tokens,
                                      workload_means)
from bench.scheduler.workload import pool_capacity_rps

SMALL = SessionSpec(groups=6, users_per_group=3)


def test_sizes_are_within_the_spec() -> None:
    spec = SessionSpec()
    ss = build_sessions(spec, seed=3)
    assert len(ss) == spec.groups * spec.users_per_group == 200
    assert [s.idx for s in ss] == list(range(200))
    assert {(s.group, s.user) for s in ss} == {(g, u) for g in range(40) for u in range(5)}
    for s in ss:
        assert 2000 <= text_tokens(s.system) <= 6000
        assert len(s.system) % CHARS_PER_TOKEN == 0
        assert 3 <= len(s.turns) <= 8
        for k, t in enumerate(s.turns):
            assert 50 <= text_tokens(t.user) <= 200 and len(t.user) % CHARS_PER_TOKEN == 0
            assert spec.lengths.min_tokens <= t.output_tokens <= spec.lengths.max_tokens
            assert t.think_s >= 0 and (k > 0 or t.think_s == 0)
    thinks = [t.think_s for s in ss for t in s.turns[1:]]
    assert 2.0 < sum(thinks) / len(thinks) < 4.0  # exponential, mean 3 s
    # the same group shares one system prompt
    by_group = {}
    for s in ss:
        assert by_group.setdefault(s.group, s.system) == s.system


def test_seeds_reproduce_and_differ() -> None:
    a = build_sessions(SMALL, seed=11)
    b = build_sessions(SMALL, seed=11)
    c = build_sessions(SMALL, seed=12)
    assert a == b
    assert a != c
    # another salt: same lengths, think times and gaps, other texts
    d = build_sessions(SMALL, seed=11, salt=5)
    for x, y in zip(a, d, strict=True):
        assert (x.group, x.user, x.start_gap) == (y.group, y.user, y.start_gap)
        assert len(x.system) == len(y.system) and x.system != y.system
        assert x.system[:BLOCK_TOKENS * CHARS_PER_TOKEN] != y.system[:BLOCK_TOKENS * CHARS_PER_TOKEN]
        assert [(len(t.user), t.output_tokens, t.think_s) for t in x.turns] == \
            [(len(t.user), t.output_tokens, t.think_s) for t in y.turns]


def test_groups_are_distinct_from_the_first_block_on() -> None:
    ss = build_sessions(SessionSpec(), seed=1)
    systems = {s.group: s.system for s in ss}
    block = BLOCK_TOKENS * CHARS_PER_TOKEN
    assert len({t[:block] for t in systems.values()}) == len(systems) == 40
    # text of varied words, not one repeated block
    for t in systems.values():
        blocks = {t[i:i + block] for i in range(0, len(t) - block, block)}
        assert len(blocks) > 0.95 * (len(t) // block)


def test_turns_extend_the_history() -> None:
    s = max(build_sessions(SMALL, seed=2), key=lambda x: len(x.turns))
    rng = random.Random(0)
    answers: list[str | None] = []
    prev: list[dict[str, str]] | None = None
    for k in range(len(s.turns)):
        msgs = s.messages(k, answers)
        assert msgs[0] == {"role": "system", "content": s.system}
        assert msgs[-1] == {"role": "user", "content": s.turns[k].user}
        if prev is not None:
            # the previous request, then its answer (when it did not fail), then the new turn
            assert msgs[:len(prev)] == prev
            extra = msgs[len(prev):]
            if answers[-1] is None:
                assert [m["role"] for m in extra] == ["user"]
            else:
                assert extra[0] == {"role": "assistant", "content": answers[-1]}
                assert [m["role"] for m in extra] == ["assistant", "user"]
        prev = msgs
        answers.append(None if k == 1 else f"answer {rng.random()}")
    with pytest.raises(ValueError):
        s.messages(2, [])
    with pytest.raises(IndexError):
        s.messages(len(s.turns), answers)
    assert len({s.request_id(k) for k in range(len(s.turns))}) == len(s.turns)


def test_means_rate_and_start_times() -> None:
    ss = build_sessions(SessionSpec(), seed=7)
    m = workload_means(ss)
    assert m.requests == sum(len(s.turns) for s in ss)
    assert 3 <= m.turns <= 8
    assert 2000 < m.prompt_tokens < 7000 and 10 < m.output_tokens < 40
    cap = pool_capacity_rps(prefix.POOL, m.output_tokens, m.prompt_tokens)
    r = session_rate(prefix.POOL, m, 0.8)
    assert r * m.turns == pytest.approx(0.8 * cap)
    st = start_times(ss, r)
    assert len(st) == len(ss) and all(b[1] > a[1] for a, b in zip(st, st[1:]))
    # faster rate: same sessions in the same order, closer together
    st2 = start_times(ss, 2 * r)
    assert [x[0].idx for x in st2] == [x[0].idx for x in st]
    assert st2[-1][1] == pytest.approx(st[-1][1] / 2)
    few = start_times(ss, r, window=st[9][1])
    assert len(few) == 9
    with pytest.raises(ValueError):
        session_rate(prefix.POOL, m, 0)


def test_pool_fits_the_workload_and_is_prefill_heavy() -> None:
    pool = prefix.POOL
    for spec in prefix.SPECS.values():
        # every request fits, a full batch of the largest ones too
        assert pool.max_running * spec.max_request_tokens <= pool.kv_capacity_tokens
    spec = prefix.SPECS["shared_prefix"]
    mean_system = sum(spec.system_tokens) / 2
    # about a quarter of the groups' prompts fit a node's cache, not all of them
    assert pool.kv_capacity_tokens < spec.groups * mean_system
    assert pool.kv_capacity_tokens >= spec.groups / 4 * mean_system
    prefill_4k = 4000 / pool.prefill_tps
    decode_16 = 16 * pool.step_s() / pool.max_running
    assert prefill_4k > 5 * decode_16
    one = build_sessions(prefix.SPECS["one_prompt"], seed=1)
    assert len({s.system for s in one}) == 1 and text_tokens(one[0].system) == 4000
    assert len({s.turns[0].user for s in one}) == len(one)


def test_counters_shares_and_record() -> None:
    text = ("# HELP vllm:prefix_cache_queries_total x\n"
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0\n'
            'vllm:prompt_tokens_total{model_name="m"} 999\n')
    assert parse_prefix_counters(text) == (150.0, 30.0)
    assert parse_prefix_counters("vllm:gpu_prefix_cache_hits_total 4\n") == (0.0, 4.0)
    assert parse_prefix_counters("other 1\n") is None
    assert state_prefix_counters({"prefix_cache": {"queries_tokens": 10, "hits_tokens": 4}}) == (10, 4)
    assert state_prefix_counters({}) is None
    rate, dq, dh = hit_rate({"a": (100, 10), "b": (0, 0)}, {"a": (200, 60), "b": (100, 50)})
    assert (rate, dq, dh) == (0.5, 200, 100)
    assert hit_rate({}, {"a": (0, 0)})[0] is None
    assert request_shares({"a": 5, "b": 0}, {"a": 8, "b": 1}) == {"a": 0.75, "b": 0.25}
    assert inflight_stats({"a": [0, 2, 4], "b": []}) == {"a": {"peak": 4.0, "mean": 2.0}}

    results = [TurnResult(idx=0, outcome="ok", status=200, e2e_s=1.0, ttft_s=0.5,
                          prompt_tokens=100, cached_tokens=60, usage_prompt_tokens=100),
               TurnResult(idx=1, outcome="timeout", prompt_tokens=200),
               TurnResult(idx=2, outcome="error", status=429, prompt_tokens=50)]
    assert sessions.client_cached_rate(results) == 0.6
    run = sessions.SessionRun(results=results, states=sessions.StateSamples(),
                              inflight=sessions.InflightSamples({"node-1": [1, 3], "node-2": [1]}),
                              window_s=2.0, wall_s=4.0)
    rec = prefix.build_record(run, scenario="shared_prefix", strategy="infergate", edges=2,
                              frac=0.8, rate_sim=0.5, ts=0.1, deadline=3.0, sessions=2,
                              before={"node-1": (0, (0.0, 0.0)), "node-2": (0, None)},
                              after={"node-1": (3, (300.0, 150.0)), "node-2": (1, None)})
    assert rec["requests"] == 3 and rec["failures"] == 2 and rec["rejected"] == 1
    assert rec["goodput_rps"] == 0.25
    assert rec["prefix_hit_rate"] == 0.5 and rec["prefix_queries_tokens"] == 300
    assert rec["share"] == {"node-1": 0.75, "node-2": 0.25} and rec["max_share_ratio"] == 1.5
    assert rec["inflight"]["node-1"] == {"peak": 3.0, "mean": 2.0}
    out = prefix.table([rec])
    assert "75/25" in out and "50" in out


def test_plan_runs_every_strategy_with_one_and_two_edges() -> None:
    plan = prefix.plan_runs(["shared_prefix", "one_prompt"], list(prefix.PREFIX_STRATEGIES),
                            [0.6, 0.8, 0.95], [1, 2])
    assert len(plan) == 3 * 2 * 4 + 2 * 4
    assert {p[3] for p in plan} == {"round_robin", "least_conn", "infergate", "infergate_noprefix"}
    assert {p[1] for p in plan if p[0] == "one_prompt"} == {prefix.ONE_PROMPT_LOAD}
    assert prefix.window_for("shared_prefix", False, None) is None
    assert prefix.window_for("one_prompt", True, None) == prefix.QUICK_WINDOW_S["one_prompt"]
    assert prefix.window_for("one_prompt", False, 33.0) == 33.0
