"""The pure figures of the traffic-shape benchmark (bench/scheduler/shapes.py): tries
read from an access log, the frozen-node figures, 429s counted against free batch slots,
the infergate / least_conn ratios and the answers of two lengths."""

from __future__ import annotations

from bench.scheduler.loadgen import Result
from bench.scheduler.shapes import (LONG_SHARE, LONG_TOKENS, access_tries, freeze_figures,
                                    prefix_requests, ratios, rejected_with_free_slot,
                                    two_lengths, two_lengths_mean)
from bench.scheduler.workload import Request, RequestMix, Workload

LOG = """\
127.0.0.1 [05/Dec/2026:04:42:36 +0000] "POST /v1/chat/completions?i=7 HTTP/1.1" 200 9 rt=1 ua="127.0.0.1:9001, 127.0.0.1:9002" us="504, 200"
127.0.0.1 [05/Dec/2026:04:42:36 +0000] "POST /v1/chat/completions?i=8 HTTP/1.1" 429 9 rt=0 ua="-" us="-"
127.0.0.1 [05/Dec/2026:04:42:36 +0000] "GET /infergate/status HTTP/1.1" 200 9 rt=0 ua="-" us="-"
"""


def test_access_tries_name_every_try_of_an_indexed_request() -> None:
    assert access_tries(LOG) == {7: ["127.0.0.1:9001", "127.0.0.1:9002"], 8: []}


def test_freeze_figures_split_routing_from_probes_and_count_lost_requests() -> None:
    frozen = "127.0.0.1:9001"
    reqs = [Request(idx=i, at_s=t, prompt="", output_tokens=4)
            for i, t in enumerate([0.5, 1.1, 1.3, 1.5, 3.0, 9.0])]
    wl = Workload(reqs, 1.0, 10.0, 1)
    tries = {0: [frozen], 1: [frozen, "x:1"], 2: [frozen], 3: ["x:1"], 4: [frozen, "x:1"],
             5: [frozen]}
    results = [Result(idx=0, outcome="ok", events=3), Result(idx=1, outcome="ok", events=3),
               Result(idx=2, outcome="timeout", events=0),
               Result(idx=3, outcome="error", status=429),
               Result(idx=4, outcome="error", events=0), Result(idx=5, outcome="ok")]
    got = freeze_figures(wl, results, tries, frozen, t_freeze=1.0, t_thaw=8.0)
    assert got["to_frozen_at_s"] == [0.1, 0.3, 2.0]      # 0.5 before, 9.0 after the thaw
    assert got["to_frozen_after_s"] == 0.3               # then a probe 1.7 s later
    assert got["to_frozen_last_s"] == 2.0
    assert got["lost_no_byte"] == 2 and got["lost_no_byte_frozen"] == 2   # a 429 is not


def test_a_429_counts_against_a_free_slot_only_when_both_samples_show_one() -> None:
    samples = [(0.0, "a", 4), (0.0, "b", 4), (1.0, "a", 4), (1.0, "b", 2), (2.0, "a", 3),
               (2.0, "b", 2)]
    results = [Result(idx=1, outcome="error", status=429),
               Result(idx=2, outcome="error", status=429),
               Result(idx=3, outcome="ok", status=200)]
    ends = {1: 0.5, 2: 1.5, 3: 1.5}
    # idx 1: b was full before it; idx 2: b had a free slot before and after
    assert rejected_with_free_slot(ends, results, samples, max_running=4) == 1


def test_ratios_pair_infergate_with_least_conn_of_the_same_load() -> None:
    base = {"scenario": "s", "load_fraction": 0.5, "failures": 4, "goodput_rps": 10.0,
            "p50_s": 1.0, "p99_s": 0.0, "ttft_p90_s": 0.5}
    rows = ratios([{**base, "strategy": "least_conn"},
                   {**base, "strategy": "infergate", "goodput_rps": 12.0, "p50_s": 0.9,
                    "failures": 1, "lost_no_byte": 0},
                   {**base, "strategy": "infergate", "load_fraction": 0.9}])
    assert rows == [{"scenario": "s", "load_pct": 50, "failures_ig": 1, "failures_base": 4,
                     "goodput_rps": 1.2, "failures": 0.25, "p50_s": 0.9, "p99_s": None,
                     "ttft_p90_s": 1.0, "lost_no_byte": 0}]


def test_prefix_requests_share_system_prompts_or_nothing() -> None:
    shared, _ = prefix_requests(60, 3, shared=True)
    systems = {m[0]["content"] for m, _ in shared}
    assert len(systems) <= 40 and len(systems) < 60
    unique, mean = prefix_requests(20, 3, shared=False)
    firsts = {m[0]["content"][:64] for m, _ in unique}      # one simnode block
    assert len(firsts) == 20 and 2000 <= mean <= 6000


def test_two_lengths_makes_the_same_requests_long_at_every_load() -> None:
    mix = RequestMix([f"prompt {i}" for i in range(50)], seed=3)
    slow, fast = (two_lengths(mix.workload(rate, 400.0), 7) for rate in (5.0, 10.0))
    long_slow = {r.idx for r in slow.requests if r.output_tokens >= LONG_TOKENS[0]}
    long_fast = {r.idx for r in fast.requests if r.output_tokens >= LONG_TOKENS[0]}
    assert long_slow and long_slow <= long_fast
    assert abs(len(long_fast) / len(fast.requests) - LONG_SHARE) < 0.05
    assert all(LONG_TOKENS[0] <= r.output_tokens <= LONG_TOKENS[1] for r in fast.requests
               if r.idx in long_fast)
    short = mix.workload(10.0, 400.0)
    assert [r.idx for r in short.requests] == [r.idx for r in fast.requests]
    mean_short = sum(r.output_tokens for r in short.requests
                     if r.idx not in long_fast) / (len(short.requests) - len(long_fast))
    assert abs(fast.mean_output_tokens - two_lengths_mean(mean_short)) < 10
