"""Parsing of /metrics bodies per dialect, from hand-written fixtures that use the real
metric names of vLLM (V1 and pre-0.10), TGI and SGLang."""

from __future__ import annotations

import pytest

from controlplane.routing.nodemetrics import (
    HistTotals, MetricsParseError, UnknownDialectError, parse_metrics, window,
)

M = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'

VLLM_V1 = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{M}}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{M}}} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{M}}} 0.21
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",{M}}} 1234.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",{M}}} 5678.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="1.0",{M}}} 2.0
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",{M}}} 10.0
vllm:e2e_request_latency_seconds_count{{engine="0",{M}}} 10.0
vllm:e2e_request_latency_seconds_sum{{engine="0",{M}}} 18.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{M}}} 10.0
vllm:time_to_first_token_seconds_count{{engine="0",{M}}} 10.0
vllm:time_to_first_token_seconds_sum{{engine="0",{M}}} 1.2
"""

# Up to 0.9.1: no engine label, KV usage under the old name.
VLLM_LEGACY = f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M}}} 1.0
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{{{M}}} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{M}}} 4.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{M}}} 0.5
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{{{M}}} 0.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{{{M}}} 3.0
vllm:e2e_request_latency_seconds_sum{{{M}}} 6.0
"""

# The deprecation window (0.9.2 to 0.10): both names; the new one must win.
VLLM_BOTH = f"""\
vllm:num_requests_waiting{{engine="0",{M}}} 0.0
vllm:num_requests_running{{engine="0",{M}}} 0.0
vllm:gpu_cache_usage_perc{{engine="0",{M}}} 0.9
vllm:kv_cache_usage_perc{{engine="0",{M}}} 0.3
"""

# Data parallel: two engine ranks, and a second model served by the same process.
VLLM_DP = f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{M}}} 3.0
vllm:num_requests_running{{engine="1",{M}}} 5.0
vllm:num_requests_running{{engine="0",model_name="lora-a"}} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{M}}} 2.0
vllm:num_requests_waiting{{engine="1",{M}}} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{M}}} 0.25
vllm:kv_cache_usage_perc{{engine="1",{M}}} 0.75
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{{engine="0",{M}}} 10.0
vllm:e2e_request_latency_seconds_sum{{engine="0",{M}}} 10.0
vllm:e2e_request_latency_seconds_count{{engine="1",{M}}} 20.0
vllm:e2e_request_latency_seconds_sum{{engine="1",{M}}} 60.0
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 4
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 2048
# TYPE tgi_request_count counter
tgi_request_count 40
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.5"} 10
tgi_request_duration_bucket{le="+Inf"} 40
tgi_request_duration_sum 80.0
tgi_request_duration_count 40
# TYPE tgi_request_input_length histogram
tgi_request_input_length_sum 4000
tgi_request_input_length_count 40
# TYPE tgi_request_generated_tokens histogram
tgi_request_generated_tokens_sum 9000
tgi_request_generated_tokens_count 40
"""

SGLANG = f"""\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{{M}}} 8.128902e+06
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{{M}}} 7.557572e+06
# TYPE sglang:token_usage gauge
sglang:token_usage{{{M}}} 0.28
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{M}}} 0.0075
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{M}}} 12.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{M}}} 3.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{{{M}}} 20.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",{M}}} 100.0
sglang:time_to_first_token_seconds_count{{{M}}} 100.0
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{{{M}}} 300.0
sglang:e2e_request_latency_seconds_bucket{{le="+Inf",{M}}} 100.0
sglang:e2e_request_latency_seconds_count{{{M}}} 100.0
"""


def test_vllm_v1():
    r = parse_metrics(VLLM_V1)
    assert r.dialect == "vllm"
    assert (r.queue_depth, r.running, r.kv_cache_usage) == (2.0, 3.0, 0.21)
    key = (("engine", "0"), ("model_name", "meta-llama/Llama-3.1-8B-Instruct"))
    assert r.e2e == {key: HistTotals(18.0, 10.0)}
    assert r.ttft == {key: HistTotals(1.2, 10.0)}
    assert r.prompt_tokens == {key: 1234.0}
    assert r.models == ("meta-llama/Llama-3.1-8B-Instruct",)
    w = window(None, r)
    assert w.prompt_tokens_total == 1234.0 and w.generation_tokens_total == 5678.0
    assert w.e2e_avg_s is None  # a single scrape says nothing about the recent past


def test_vllm_legacy_rename():
    r = parse_metrics(VLLM_LEGACY)
    assert r.dialect == "vllm-legacy"
    assert (r.queue_depth, r.running, r.kv_cache_usage) == (4.0, 1.0, 0.5)


def test_vllm_deprecation_window_prefers_new_name():
    r = parse_metrics(VLLM_BOTH)
    assert r.dialect == "vllm"
    assert r.kv_cache_usage == 0.3


def test_two_engine_ranks_and_models_sum_queue_and_running_max_kv():
    r = parse_metrics(VLLM_DP)
    assert r.queue_depth == 9.0
    assert r.running == 9.0
    assert r.kv_cache_usage == 0.75
    assert r.engines == 2
    assert r.models == ("lora-a", "meta-llama/Llama-3.1-8B-Instruct")


def _dp_hist(c0: float, s0: float, c1: float, s1: float) -> str:
    return (f'vllm:e2e_request_latency_seconds_count{{engine="0",{M}}} {c0}\n'
            f'vllm:e2e_request_latency_seconds_sum{{engine="0",{M}}} {s0}\n'
            f'vllm:e2e_request_latency_seconds_count{{engine="1",{M}}} {c1}\n'
            f'vllm:e2e_request_latency_seconds_sum{{engine="1",{M}}} {s1}\n')


def test_two_engine_ranks_latency_is_request_weighted():
    before = parse_metrics(_dp_hist(10, 10.0, 20, 60.0))
    # engine 0: +1 request taking 1 s; engine 1: +3 requests taking 9 s in all.
    after = parse_metrics(_dp_hist(11, 11.0, 23, 69.0))
    w = window(before, after)
    assert w.finished == 4.0
    assert w.e2e_avg_s == pytest.approx(10.0 / 4)


def test_tgi():
    r = parse_metrics(TGI)
    assert r.dialect == "tgi"
    assert (r.queue_depth, r.running) == (6.0, 4.0)
    assert r.kv_cache_usage is None
    assert r.ttft is None
    assert r.e2e == {(): HistTotals(80.0, 40.0)}
    w = window(None, r)
    assert (w.prompt_tokens_total, w.generation_tokens_total) == (4000.0, 9000.0)


def test_sglang():
    r = parse_metrics(SGLANG)
    assert r.dialect == "sglang"
    assert (r.queue_depth, r.running, r.kv_cache_usage) == (3.0, 12.0, 0.28)
    assert window(None, r).generation_tokens_total == pytest.approx(7.557572e6)


def test_sglang_underscore_prefix_reads_the_same():
    r = parse_metrics(SGLANG.replace("sglang:", "sglang_"))
    assert r.dialect == "sglang"
    assert (r.queue_depth, r.running, r.kv_cache_usage) == (3.0, 12.0, 0.28)


def test_untyped_scrape_reads_the_same():
    bare = "\n".join(line for line in VLLM_V1.splitlines() if not line.startswith("#"))
    r = parse_metrics(bare + "\n")
    assert (r.dialect, r.queue_depth, r.running, r.kv_cache_usage) == ("vllm", 2.0, 3.0, 0.21)


def test_json_dialect():
    r = parse_metrics('{"queue_depth": 5, "avg_latency_seconds": 1.5, "gpu_memory_utilization": 0.6}')
    assert r.dialect == "json"
    assert (r.queue_depth, r.kv_cache_usage, r.running) == (5.0, 0.6, None)
    assert window(None, r).e2e_avg_s == 1.5


def test_json_dialect_percent_and_bad_values():
    r = parse_metrics('{"queue_depth": -1, "avg_latency_seconds": "slow", '
                      '"gpu_memory_utilization": 85, "running": true}',
                      content_type="application/json")
    assert r.queue_depth is None and r.e2e_avg_s_direct is None and r.running is None
    assert r.kv_cache_usage == pytest.approx(0.85)
    assert parse_metrics('{"gpu_memory_utilization": 1000}').kv_cache_usage is None


@pytest.mark.parametrize("body", ["[1, 2]", "{not json", '"x"'])
def test_json_malformed(body):
    with pytest.raises(MetricsParseError):
        parse_metrics(body, content_type="application/json")


def test_json_without_known_keys():
    with pytest.raises(UnknownDialectError):
        parse_metrics('{"status": "ok"}')


@pytest.mark.parametrize("body", ["<html><body>502 Bad Gateway</body></html>",
                                  "garbage line here\n"])
def test_malformed_prometheus(body):
    with pytest.raises(MetricsParseError):
        parse_metrics(body)


@pytest.mark.parametrize("body", ["", "process_cpu_seconds_total 12.5\npython_info 1\n",
                                  "lmdeploy:requests_processing 1\n"])
def test_unknown_dialect(body):
    with pytest.raises(UnknownDialectError):
        parse_metrics(body)


def test_llamacpp_names_are_the_llamacpp_dialect():
    r = parse_metrics("llamacpp:requests_processing 1\n")
    assert (r.dialect, r.running, r.queue_depth) == ("llamacpp", 1.0, None)


def test_nan_gauge_is_unknown_and_values_are_clamped():
    r = parse_metrics("vllm:num_requests_waiting NaN\nvllm:num_requests_running -3\n"
                      "vllm:kv_cache_usage_perc 1.7\n")
    assert r.queue_depth is None
    assert r.running == 0.0
    assert r.kv_cache_usage == 1.0
