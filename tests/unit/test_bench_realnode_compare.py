"""The pure parts of ``python -m bench.realnode compare``: seeded arrival schedules, the
run order, cut-stream detection, the llama-server metrics, the per-run statistics on
synthetic records, the means over repeats and the noise between them."""

from __future__ import annotations

import argparse

import pytest

from bench.realnode import compare
from bench.realnode import compare_stats as cs
from bench.realnode.compare_load import (NodeSamples, RealResult, burst_workload, event_facts,
                                         is_cut, parse_metrics, request_body)
from bench.scheduler.workload import RequestMix

PROMPTS = [f"question number {i}?" for i in range(40)]


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


# --------------------------------------------------------------------------- schedules

def test_steady_schedule_is_seeded_and_scales_with_the_load() -> None:
    args = _args(duration=20.0, seed=3)
    a = compare.make_workload(RequestMix(PROMPTS, seed=3), "steady", 0.5, 4.0, args)
    b = compare.make_workload(RequestMix(PROMPTS, seed=3), "steady", 0.5, 4.0, args)
    c = compare.make_workload(RequestMix(PROMPTS, seed=4), "steady", 0.5, 4.0, args)
    high = compare.make_workload(RequestMix(PROMPTS, seed=3), "steady", 1.0, 4.0, args)
    assert a.requests == b.requests and a.requests != c.requests
    assert a.rate_rps == 2.0 and high.rate_rps == 4.0
    assert all(0 <= r.at_s < 20.0 for r in a.requests)
    # the same requests in the same order, only closer together
    n = len(a.requests)
    assert [(r.prompt, r.output_tokens) for r in high.requests[:n]] == [
        (r.prompt, r.output_tokens) for r in a.requests]
    assert high.requests[n - 1].at_s == pytest.approx(a.requests[n - 1].at_s / 2)


def test_burst_schedule_is_a_quiet_spell_then_the_burst() -> None:
    def make(seed: int):
        return burst_workload(RequestMix(PROMPTS, seed=1), 4.0, 20.0, quiet_s=10.0,
                              burst_size=12, burst_s=1.0, quiet_fraction=0.1, seed=seed)

    wl = make(5)
    assert wl.requests == make(5).requests
    assert [r.at_s for r in wl.requests] != [r.at_s for r in make(6).requests]
    times = [r.at_s for r in wl.requests]
    assert times == sorted(times)
    assert [r.idx for r in wl.requests] == list(range(len(times)))
    burst = [t for t in times if t >= 10.0]
    quiet = [t for t in times if t < 10.0]
    assert len(burst) == 12 and all(t < 11.0 for t in burst)
    assert 0 < len(quiet) < 12   # about 0.4 req/s for 10 s
    assert wl.rate_rps == pytest.approx(len(times) / 20.0) and wl.duration_s == 20.0
    firsts = RequestMix(PROMPTS, seed=1).workload(1.0, 200.0).requests[:len(times)]
    assert [(r.prompt, r.output_tokens) for r in wl.requests] == [
        (r.prompt, r.output_tokens) for r in firsts]
    none_quiet = burst_workload(RequestMix(PROMPTS), 4.0, 20.0, quiet_s=10.0, burst_size=3,
                                quiet_fraction=0.0)
    assert [r.at_s >= 10.0 for r in none_quiet.requests] == [True] * 3
    with pytest.raises(ValueError, match="inside the window"):
        burst_workload(RequestMix(PROMPTS), 4.0, 10.0, quiet_s=9.5, burst_size=3)
    with pytest.raises(ValueError):
        burst_workload(RequestMix(PROMPTS), 4.0, 10.0, quiet_s=5.0, burst_size=0)


def test_burst_size_follows_the_capacity() -> None:
    wl = compare.make_workload(RequestMix(PROMPTS), "burst", None, 2.0,
                               _args(duration=20.0, burst_size=3.0, seed=1))
    assert sum(1 for r in wl.requests if r.at_s >= 10.0) == 6


def test_runs_are_interleaved_strategy_by_strategy() -> None:
    plan = compare.plan_runs([0.5, 1.2], True, 2, ["least_conn", "infergate"])
    assert plan[:4] == [("steady", 0.5, 1, "least_conn"), ("steady", 0.5, 1, "infergate"),
                        ("steady", 0.5, 2, "least_conn"), ("steady", 0.5, 2, "infergate")]
    assert plan[-1] == ("burst", None, 2, "infergate") and len(plan) == 12
    assert compare.plan_runs([0.9], False, 1, ["least_conn"]) == [("steady", 0.9, 1, "least_conn")]


def test_the_request_asks_for_an_exact_length() -> None:
    req = RequestMix(PROMPTS).workload(1.0, 30.0).requests[0]
    body = request_body(req)
    assert body["max_tokens"] == req.output_tokens and body["ignore_eos"] is True
    assert body["stream"] is True and body["messages"][0]["content"] == req.prompt
    assert body["model"] == "gemma-3-270m"


# --------------------------------------------------------------------------- streams

def test_event_facts_reads_text_and_finish_reason() -> None:
    assert event_facts(b'{"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}') == (True, None)
    assert event_facts(b'{"choices":[{"delta":{},"finish_reason":"length"}]}') == (False, "length")
    assert event_facts(b'{"choices":[{"delta":{"role":"assistant"}}]}') == (False, None)
    assert event_facts(b"not json") == (False, None)
    assert event_facts(b'{"choices":[]}') == (False, None)


def test_cut_stream_detection() -> None:
    ok = RealResult(idx=0, outcome="ok", status=200, e2e_s=1.0)
    assert not is_cut(ok, "length")
    assert is_cut(ok, None)                                   # [DONE] but no finish_reason
    ended = RealResult(idx=1, outcome="error", status=200, error="stream ended without [DONE]")
    assert is_cut(ended, "length") and is_cut(ended, None)
    reset = RealResult(idx=2, outcome="error", status=200, error="ClientPayloadError: reset")
    assert is_cut(reset, None)
    assert not is_cut(RealResult(idx=3, outcome="timeout", status=200), None)
    assert not is_cut(RealResult(idx=4, outcome="error", status=429), None)
    assert not is_cut(RealResult(idx=5, outcome="error", status=None), None)


# --------------------------------------------------------------------------- node metrics

METRICS = """# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
llamacpp:tokens_predicted_total 120
llamacpp:broken
other_metric 5
"""


def test_parse_metrics_and_the_node_split() -> None:
    assert parse_metrics(METRICS) == {"requests_processing": 2.0, "requests_deferred": 1.0,
                                      "tokens_predicted_total": 120.0}
    s = NodeSamples()
    for proc, dfr, tok in ((1, 2, 100), (1, 0, 130), (0, 0, 160)):
        s.add("p1-1", {"requests_processing": proc, "requests_deferred": dfr,
                       "tokens_predicted_total": tok})
    for proc, tok in ((3, 10), (0, 40)):
        s.add("p3-2", {"requests_processing": proc, "tokens_predicted_total": tok})
    split = cs.node_split(s, {"p1-1": 1, "p3-2": 3})
    assert list(split) == ["p1-1", "p3-2"]
    assert split["p1-1"] == {"tokens": 60, "token_share": pytest.approx(0.667, abs=1e-3),
                             "utilisation": pytest.approx(0.667, abs=1e-3),
                             "deferred_mean": pytest.approx(0.667, abs=1e-3), "deferred_max": 2}
    assert split["p3-2"]["tokens"] == 30 and split["p3-2"]["utilisation"] == 0.5
    empty = cs.node_split(NodeSamples(), {"n": 2})["n"]
    assert empty["token_share"] is None and empty["utilisation"] is None


# --------------------------------------------------------------------------- records

def _results() -> list[RealResult]:
    return [RealResult(idx=0, outcome="ok", status=200, e2e_s=1.0, ttft_s=0.2, finish_reason="length"),
            RealResult(idx=1, outcome="ok", status=200, e2e_s=3.0, ttft_s=0.4, finish_reason="length"),
            RealResult(idx=2, outcome="timeout", status=200, ttft_s=None),
            RealResult(idx=3, outcome="error", status=429, error="HTTP 429"),
            RealResult(idx=4, outcome="error", status=200, cut=True, ttft_s=0.3)]


def test_run_record_on_synthetic_results() -> None:
    s = NodeSamples()
    s.add("a", {"tokens_predicted_total": 0})
    s.add("a", {"tokens_predicted_total": 10})
    rec = cs.run_record(_results(), head={"scenario": "steady", "strategy": "infergate"},
                        deadline_s=10.0, window_s=2.0, samples=s, slots={"a": 1})
    assert rec["scenario"] == "steady" and rec["requests"] == 5 and rec["ok"] == 2
    assert (rec["timeouts"], rec["errors"], rec["rejected"], rec["cut"]) == (1, 2, 1, 1)
    assert rec["goodput_rps"] == 1.0 and rec["sent_rps"] == 2.5
    assert rec["rejected_rate"] == 0.2 and rec["cut_rate"] == 0.2 and rec["timeout_rate"] == 0.2
    assert rec["p50_s"] == 3.0                     # 1, 3 and the timeout counted as 10
    assert rec["ttft_p50_s"] == 0.4                # 0.2, 0.4, 10 (no text before the deadline)
    assert rec["nodes"]["a"]["token_share"] == 1.0
    with pytest.raises(ValueError):
        cs.run_record([], head={}, deadline_s=0.0, window_s=1.0, samples=s, slots={})


def _run(strategy: str, goodput: float, p99: float, load: float = 0.5, rep: int = 1) -> dict:
    return {"scenario": "steady", "load_fraction": load, "strategy": strategy, "repeat": rep,
            "offered_rps": 2.0, "sent_rps": 2.0, "goodput_rps": goodput, "p50_s": 1.0,
            "p99_s": p99, "ttft_p50_s": 0.2, "ttft_p90_s": 0.5, "timeout_rate": 0.0,
            "rejected_rate": 0.1, "cut_rate": 0.0, "error_rate": 0.1, "cut": 0, "rejected": 1,
            "nodes": {"p1-1": {"token_share": 0.4, "deferred_mean": 1.0},
                      "p3-2": {"token_share": 0.6, "deferred_mean": 0.0}}}


RUNS = [_run("least_conn", 1.8, 4.0), _run("infergate", 2.0, 3.0),
        _run("least_conn", 1.6, 5.0, rep=2), _run("infergate", 1.9, 2.0, rep=2)]


def test_means_over_repeats() -> None:
    rows = cs.aggregate(RUNS)
    assert [(r["strategy"], r["runs"]) for r in rows] == [("least_conn", 2), ("infergate", 2)]
    lc = rows[0]
    assert lc["goodput_rps"] == pytest.approx(1.7) and lc["p99_s"] == 4.5 and lc["rejected"] == 2
    assert lc["nodes"]["p1-1"] == {"token_share": 0.4, "deferred_mean": 1.0}
    text = cs.table(RUNS)
    assert "tokens % p1-1/p3-2" in text and " 40/60 |" in text and "429 %" in text


def test_noise_is_the_spread_between_repeats() -> None:
    rows = {r["strategy"]: r for r in cs.noise(RUNS)}
    lc, ig = rows["least_conn"], rows["infergate"]
    assert lc["goodput_rps"] == {"min": 1.6, "max": 1.8, "spread": 0.2,
                                 "spread_pct": pytest.approx(11.8, abs=0.05)}
    assert "delta_goodput_rps" not in lc
    assert ig["delta_goodput_rps"] == pytest.approx(0.25)
    assert ig["beyond_noise_goodput_rps"] is True      # 1.9-2.0 against 1.6-1.8
    assert ig["delta_p99_s"] == pytest.approx(-2.0)
    assert ig["beyond_noise_p99_s"] is True            # 2-3 against 4-5
    overlap = RUNS + [_run("infergate", 1.7, 4.5, rep=3)]
    ig3 = {r["strategy"]: r for r in cs.noise(overlap)}["infergate"]
    assert ig3["beyond_noise_goodput_rps"] is False and ig3["beyond_noise_p99_s"] is False
    single = {r["strategy"]: r for r in cs.noise(RUNS[:2])}["infergate"]
    assert single["beyond_noise_goodput_rps"] is None   # one repeat: no noise known
    summary = cs.noise_summary(cs.noise(RUNS))
    assert summary["groups"] == 2
    assert summary["p99_s"]["max_spread_pct"] == pytest.approx(40.0)
    assert "goodput median" in cs.noise_line(RUNS)
    assert "no spread" in cs.noise_line(RUNS[:2])
    text = cs.noise_table(RUNS)
    assert "1.60-1.80" in text and " yes |" in text


def test_the_printed_report_has_both_tables_the_capacity_and_the_note() -> None:
    data = {"calibration": {"capacity_rps": 2.5, "nodes": {"p1-1": {"slots": 1, "rps": 1.0},
                                                           "p3-2": {"slots": 3, "rps": 1.5}}},
            "runs": RUNS}
    meta = {"window_s": 20.0, "deadline_s": 20.0, "threads": 1, "note": "machine busy"}
    text = cs.report_text(data, meta)
    assert text.count("| scenario ") == 2 and "goodput/s min-max" in text
    assert "capacity 2.50 req/s (p1-1 (1 slots) 1.00/s, p3-2 (3 slots) 1.50/s; calibration)" in text
    assert text.endswith("note: machine busy") and "noise (spread between repeats" in text


def test_the_freeze_run_comes_last_and_has_its_own_table() -> None:
    plan = compare.plan_runs([0.9], False, 1, ["least_conn", "infergate"], freeze=0.5)
    assert plan[-2:] == [("freeze", 0.5, 1, "least_conn"), ("freeze", 0.5, 1, "infergate")]
    frozen = {**_run("infergate", 2.0, 3.0), "scenario": "freeze", "timeouts": 1, "errors": 0,
              "requests": 40, "frozen_node": "p3-2", "freeze_s": 25.0,
              "to_frozen_at_s": [], "found_after_s": 0.4, "lost_no_byte": 0}
    lc = {**frozen, "strategy": "least_conn", "to_frozen_at_s": [0.5, 1.25, 3.0],
          "found_after_s": None, "lost_no_byte": 3}
    text = cs.freeze_table([RUNS[0], lc, frozen])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()[2:]]
    assert [r[0] for r in rows] == ["least_conn", "infergate"]
    # sent to frozen, at s after the freeze, found stalled s, lost no byte
    assert rows[0][8:] == ["3", "0.5 1.25 3", "-", "3"]
    assert rows[1][8:] == ["0", "-", "0.400", "0"]
    assert rows[1][6] == "2"                       # failures: 1 timeout + 0 errors + 1 × 429
    assert cs.freeze_table(RUNS) == ""
    data = {"calibration": {"capacity_rps": 2.5, "nodes": {}}, "runs": RUNS + [lc, frozen]}
    assert "found stalled s" in cs.report_text(data, {"window_s": 20.0, "deadline_s": 20.0,
                                                      "threads": 1})


def test_the_first_cluster_of_sends_ends_at_the_first_gap() -> None:
    assert compare.first_cluster_end([]) == 0.0
    assert compare.first_cluster_end([0.5, 0.6, 1.0, 3.0, 3.1]) == 1.0
    assert compare.first_cluster_end([2.0]) == 2.0
