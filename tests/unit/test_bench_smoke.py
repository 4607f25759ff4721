"""The benchmark modules import, and their statistics and record building give the
right numbers on synthetic data (pure logic: no process is started)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.edge_overhead import __main__ as edge_main  # noqa: E402
from bench.edge_overhead import wrk  # noqa: E402
from bench.scheduler import report, stack, stats, workload  # noqa: E402
from bench.scheduler.loadgen import Result, StateSamples, request_body  # noqa: E402


# --------------------------------------------------------------------------- common

def test_percentile_matches_linear_interpolation():
    assert common.percentile([1, 2, 3, 4], 50) == 2.5
    assert common.percentile(list(range(101)), 99) == 99.0
    assert common.percentile([5.0], 99) == 5.0
    assert common.percentile([3, 1, 2], 0) == 1.0
    assert common.percentile([3, 1, 2], 100) == 3.0
    assert common.percentile([], 50) is None
    with pytest.raises(ValueError):
        common.percentile([1.0], 101)


def test_load_prompts_from_folder_file_and_errors(tmp_path):
    d = tmp_path / "eval"
    d.mkdir()
    (d / "a.jsonl").write_text('{"origin": "How are you?", "similar": "How do you do?"}\n'
                               'not json\n{"origin": "How are you?", "n": 3}\n', encoding="utf-8")
    (d / "b.tsv").write_text("text1\ttext2\tlabel\n你好吗\t你好\t1\n", encoding="utf-8")
    assert common.load_prompts(d) == ["How are you?", "How do you do?", "你好吗", "你好"]
    f = tmp_path / "p.txt"
    f.write_text("first\n\n  second  \nfirst\n", encoding="utf-8")
    assert common.load_prompts(f) == ["first", "second"]
    with pytest.raises(common.BenchError, match="no such file"):
        common.load_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(common.BenchError, match="no prompt found"):
        common.load_prompts(tmp_path / "empty.txt")


def test_format_table_aligns_and_marks_missing():
    text = common.format_table([{"a": "x", "b": 1.23456, "c": None}, {"a": "yy", "b": 250.0}],
                               [("a", "A"), ("b", "B"), ("c", "C")])
    lines = text.splitlines()
    assert lines[0] == "| A  | B    | C |"
    assert "1.23" in lines[2] and "| - |" in lines[2]
    assert "250" in lines[3]
    assert len({len(line) for line in lines}) == 1


# --------------------------------------------------------------------------- workload

def test_capacity_formula():
    spec = workload.PoolSpec(max_running=4, decode_base_ms=100, decode_per_seq_ms=5,
                             prefill_tps=4000)
    # step(4) = 0.12 s; 20 tokens -> 0.6 s of node time per request; 8 prompt tokens -> 2 ms
    cap = workload.node_capacity_rps(1.0, spec, 20.0, 8.0)
    assert cap == pytest.approx(1 / 0.602)
    assert workload.node_capacity_rps(1 / 3, spec, 20.0, 8.0) == pytest.approx(cap / 3)
    assert workload.pool_capacity_rps(spec, 20.0, 8.0) == pytest.approx(2 * cap + 2 * cap / 3)
    with pytest.raises(ValueError):
        workload.node_capacity_rps(0, spec, 20.0, 8.0)


def test_request_mix_is_seeded_and_shared_across_rates():
    prompts = [f"prompt number {i}" for i in range(50)]
    a = workload.RequestMix(prompts, seed=3).workload(10.0, 20.0)
    b = workload.RequestMix(prompts, seed=3).workload(10.0, 20.0)
    assert a.requests == b.requests
    fast = workload.RequestMix(prompts, seed=3).workload(20.0, 20.0)
    # same requests in the same order, arriving twice as densely
    for r1, r2 in zip(a.requests, fast.requests):
        assert (r1.prompt, r1.output_tokens) == (r2.prompt, r2.output_tokens)
        assert r2.at_s == pytest.approx(r1.at_s / 2)
    assert len(fast.requests) > len(a.requests)
    assert all(0 <= r.at_s < 20.0 for r in fast.requests)
    assert 150 < len(a.requests) < 250  # Poisson(200)
    d = workload.LengthDist()
    assert all(d.min_tokens <= r.output_tokens <= d.max_tokens for r in fast.requests)
    # the first 50 requests use every prompt once (drawn without replacement)
    assert len({r.prompt for r in fast.requests[:50]}) == 50
    c = workload.RequestMix(prompts, seed=4).workload(10.0, 20.0)
    assert c.requests != a.requests


def test_length_distribution_is_heavy_tailed_and_clipped():
    d = workload.LengthDist(median=16, sigma=0.9, min_tokens=2, max_tokens=64)
    rng = random.Random(1)
    xs = [d.draw(rng) for _ in range(20000)]
    assert min(xs) >= 2 and max(xs) == 64
    assert 15 <= common.percentile(xs, 50) <= 17
    assert common.mean(xs) > common.percentile(xs, 50)  # right-skewed
    with pytest.raises(ValueError):
        workload.LengthDist(min_tokens=5, max_tokens=4)


def test_request_body_and_prompt_tokens():
    req = workload.Request(idx=0, at_s=0.0, prompt="abcdefghi", output_tokens=7)
    body = request_body(req)
    assert body["stream"] is True and body["sim_output_tokens"] == 7
    assert body["messages"] == [{"role": "user", "content": "abcdefghi"}]
    assert workload.prompt_tokens("abcdefghi") == 3
    assert workload.prompt_tokens("") == 1


# --------------------------------------------------------------------------- statistics

def _results() -> list[Result]:
    out = [Result(idx=i, outcome="ok", status=200, e2e_s=float(i + 1), ttft_s=0.1 * (i + 1))
           for i in range(8)]  # e2e 1..8 s
    out.append(Result(idx=8, outcome="timeout", status=200, ttft_s=2.0))
    out.append(Result(idx=9, outcome="timeout"))
    out.append(Result(idx=10, outcome="error", status=429, error="HTTP 429: busy"))
    out.append(Result(idx=11, outcome="error", error="ClientConnectorError: refused"))
    return out


def test_summarise_counts_timeouts_at_the_deadline_and_leaves_errors_out():
    states = StateSamples(running={"fast-1": [4, 4, 2, 2], "slow-1": [0, 1, 0, 1], "bad": [0, 0]},
                          requests_total={"fast-1": (10, 40), "slow-1": (5, 15), "bad": (0, 0)})
    rec = stats.summarise(_results(), deadline_s=10.0, duration_s=4.0, states=states,
                          max_running=4, faulty=["bad"])
    assert (rec["requests"], rec["ok"], rec["timeouts"], rec["errors"], rec["rejected"]) == (12, 8, 2, 2, 1)
    # e2e samples: 1..8 and 10, 10 -> p50 = 5.5
    assert rec["p50_s"] == 5.5
    assert rec["p99_s"] == pytest.approx(10.0)
    assert rec["p99_ok_s"] == pytest.approx(common.percentile(list(range(1, 9)), 99), abs=1e-4)
    # ttft samples: 0.1..0.8, 2.0 (timed out after text) and 10 (no text)
    assert rec["ttft_p50_s"] == pytest.approx(0.55)
    assert rec["timeout_rate"] == pytest.approx(2 / 12, abs=1e-4)
    assert rec["error_rate"] == pytest.approx(2 / 12, abs=1e-4)
    assert rec["goodput_rps"] == 2.0 and rec["sent_rps"] == 3.0
    assert rec["utilisation"] == {"bad": 0.0, "fast-1": 0.75, "slow-1": 0.125}
    assert rec["busy"] == {"bad": 0.0, "fast-1": 1.0, "slow-1": 0.5}
    assert rec["imbalance"] == 0.625  # the faulty node is left out
    assert rec["share"] == {"bad": 0.0, "fast-1": 0.75, "slow-1": 0.25}
    assert rec["statuses"] == {"200": 9, "429": 1, "none": 2}
    json.dumps(rec)


def test_summarise_edge_cases():
    rec = stats.summarise([], deadline_s=6.0, duration_s=10.0)
    assert rec["requests"] == 0 and rec["p99_s"] is None and rec["timeout_rate"] == 0.0
    assert rec["imbalance"] is None
    with pytest.raises(ValueError):
        stats.summarise([], deadline_s=0, duration_s=1)
    assert stats.imbalance({"a": 0.5}) is None
    assert stats.shares({"a": (3, 3)}) == {"a": 0.0}
    with pytest.raises(ValueError):
        stats.utilisation({"a": [1]}, 0)


def report_records() -> list[dict]:
    """Records of three scenario/load points for every strategy (report tests)."""
    base = {"offered_rps": 10.0, "sent_rps": 10.2, "p50_s": 1.0, "p99_s": 3.0,
            "ttft_p99_s": 0.5, "timeout_rate": 0.015, "error_rate": 0.0,
            "goodput_rps": 9.9, "imbalance": 0.1}
    return [dict(base, scenario=sc, strategy=s, load_fraction=f)
            for sc, f in (("steady", 0.5), ("steady", 1.2), ("node_hang", 0.8))
            for s in stack.STRATEGIES]


def test_report_table():
    recs = report_records()
    text = report.table(recs)
    assert "| steady" in text and "1.5" in text and text.count("\n") == len(recs) + 1


def test_plain_nginx_config_and_infergate_settings(tmp_path):
    class N:
        def __init__(self, port):
            self.port = port
            self.url = f"http://127.0.0.1:{port}"
            self.name = f"n{port}"

    nodes = [N(9001), N(9002)]
    conf = stack.render_plain("least_conn", nodes, tmp_path / "lc", 8000, 0.2).read_text()
    assert "least_conn;" in conf and "server 127.0.0.1:9002 max_fails=1 fail_timeout=2s;" in conf
    assert "proxy_read_timeout 12000ms;" in conf and "listen 127.0.0.1:8000;" in conf
    rr = stack.render_plain("round_robin", nodes, tmp_path / "rr", 8001, 0.05).read_text()
    assert "least_conn" not in rr and "fail_timeout=1s" in rr
    with pytest.raises(ValueError):
        stack.render_plain("infergate", nodes, tmp_path / "x", 8002, 0.2)
    s = stack.infergate_settings("redis://127.0.0.1:1/0", nodes, workload.PoolSpec(), 0.2)
    assert s.controlplane.poll_interval_s == pytest.approx(0.2)
    assert s.edge.read_timeout_ms == 12000 and s.scoring.latency_norm_s == pytest.approx(6.0)
    assert [n.max_concurrency for n in s.nodes] == [8, 8]
    assert s.deadlines.request_ms == 6000 and s.admission.max_wait_ms == 100
    assert s.cache.enabled is False and s.auth.mode == "off"


# --------------------------------------------------------------------------- wrk

WRK_OUTPUT = """\
Running 4s test @ http://127.0.0.1:1234/v1/chat/completions
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   812.34us  301.22us   9.87ms   91.00%
    Req/Sec    19.80k     1.02k   21.30k    80.00%
  Latency Distribution
     50%  760.00us
     75%    0.90ms
     90%    1.10ms
     99%    2.01ms
  79012 requests in 4.00s, 30.12MB read
  Non-2xx or 3xx responses: 3
  Socket errors: connect 0, read 1, write 0, timeout 2
Requests/sec:  19753.00
Transfer/sec:      7.53MB
STATUSES {"200": 79009, "503": 3, "cache:HIT": 79000}
"""


def test_wrk_report_parsing():
    r = wrk.parse(WRK_OUTPUT)
    assert r.rps == 19753.0 and r.requests == 79012 and r.duration_s == 4.0
    assert r.p50_ms == pytest.approx(0.76) and r.p90_ms == pytest.approx(1.1)
    assert r.p99_ms == pytest.approx(2.01)
    assert r.non_2xx == 3 and r.socket_errors == 3
    assert r.statuses == {"200": 79009, "503": 3, "cache:HIT": 79000}
    assert wrk.duration_ms("2.00s") == 2000.0
    with pytest.raises(ValueError):
        wrk.duration_ms("fast")
    with pytest.raises(wrk.WrkError):
        wrk.parse("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_wrk_post_script_holds_bodies_verbatim():
    tricky = '{"a": "]] and ]=] inside"}'
    script = wrk.post_script(['{"x": 1}', tricky], {"Content-Type": "application/json"})
    assert 'wrk.method = "POST"' in script
    assert "[==[" + tricky + "]==]" in script
    assert "wrk.headers[ [[Content-Type]] ] = [[application/json]]" in script
    assert "STATUSES" in script
    with pytest.raises(ValueError):
        wrk.post_script([], {})


def test_edge_overhead_records_ratios_and_unavailable_rows():
    rows = {
        "direct": {"row": "direct", "available": True, "rps": 30000.0, "p50_ms": 0.4, "p99_ms": 1.0},
        "nginx_proxy": {"row": "nginx_proxy", "available": True, "rps": 20000.0, "p50_ms": 0.8,
                        "p99_ms": 2.0},
        "infergate": {"row": "infergate", "available": True, "rps": 10000.0, "p50_ms": 1.6,
                      "p99_ms": 5.0},
        "infergate_admission": {"row": "infergate_admission", "available": True, "rps": 17000.0,
                                "p50_ms": 0.9, "p99_ms": 3.5},
        "lua_floor": {"row": "lua_floor", "available": True, "rps": 16000.0, "p50_ms": 0.9,
                      "p99_ms": 2.5},
        "infergate_exact_hit": {"row": "infergate_exact_hit", "available": False,
                                "reason": "no cache"},
        "length_coalesce_on": {"row": "length_coalesce_on", "available": True, "rps": 900.0,
                               "p50_ms": 1.0, "p99_ms": 2.0,
                               "statuses": {"200": 90, "cache:HIT": 81, "cache:MISS": 9}},
        "length_coalesce_off": {"row": "length_coalesce_off", "available": True, "rps": 1000.0,
                                "p50_ms": 1.0, "p99_ms": 2.0},
    }
    recs = edge_main.finish_records(rows)
    assert [r["row"] for r in recs] == list(edge_main.ROWS)
    by = {r["row"]: r for r in recs}
    ig = by["infergate"]
    assert (ig["rps_ratio"], ig["p50_ratio"], ig["p99_ratio"]) == (0.5, 2.0, 2.5)
    assert ig["p99_added_ms"] == 3.0 and ig["connections"] == 16
    assert by["direct"]["rps_ratio"] == 1.5
    assert by["infergate_exact_hit"]["available"] is False and "rps_ratio" not in by["infergate_exact_hit"]
    assert by["infergate_semantic_hit"] == {"row": "infergate_semantic_hit", "available": False,
                                            "reason": "not measured"}
    on = by["length_coalesce_on"]
    assert on["reference"] == "length_coalesce_off" and on["rps_ratio"] == 0.9
    assert on["hit_share"] == 0.9
    table = common.format_table(edge_main.table_rows(recs), edge_main.COLUMNS)
    assert table.count("not available") == len(edge_main.ROWS) - 7
    lines = edge_main.target_checks(recs, None)
    assert lines[0].startswith("infergate_admission (-c16)") and lines[0].endswith("-> met")
    assert "; floor lua_floor: 0.800x ->" in lines[0]  # the bound any Lua edge pays
    assert "not measured" in lines[1]  # c256 row absent
    assert lines[-2].endswith("MISSED")  # coalescing on at 0.9x of off


def test_space_variants_are_distinct_and_keep_the_words():
    text = "How do I improve my spoken English?"
    assert edge_main.space_variant(text, 0) == text
    assert edge_main.space_variant(text, 1) == "How  do I improve my spoken English?"
    assert edge_main.space_variant(text, 1 << 6) == text + " "
    variants = {edge_main.space_variant(text, i) for i in range(5000)}
    assert len(variants) == 5000
    assert {" ".join(v.split()) for v in variants} == {text}
