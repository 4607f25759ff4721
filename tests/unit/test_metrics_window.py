"""Deltas between two scrapes: counter resets, new series, no new data -> None."""

from __future__ import annotations

import pytest

from controlplane.routing.nodemetrics import counter_delta, hist_delta, parse_metrics, window

M = 'model_name="m"'


def scrape(e2e_count: float, e2e_sum: float, ttft_count: float = 0, ttft_sum: float = 0,
           gen: float = 0, engine: str = "0") -> str:
    lab = f'engine="{engine}",{M}'
    return (f"vllm:num_requests_waiting{{{lab}}} 0\n"
            f"vllm:kv_cache_usage_perc{{{lab}}} 0.1\n"
            f"vllm:generation_tokens_total{{{lab}}} {gen}\n"
            f"vllm:e2e_request_latency_seconds_count{{{lab}}} {e2e_count}\n"
            f"vllm:e2e_request_latency_seconds_sum{{{lab}}} {e2e_sum}\n"
            f"vllm:time_to_first_token_seconds_count{{{lab}}} {ttft_count}\n"
            f"vllm:time_to_first_token_seconds_sum{{{lab}}} {ttft_sum}\n")


def test_recent_latency_from_histogram_delta():
    a = parse_metrics(scrape(100, 500.0, 100, 10.0, gen=1000))
    b = parse_metrics(scrape(104, 508.0, 104, 10.8, gen=1400))
    w = window(a, b)
    assert w.e2e_avg_s == pytest.approx(2.0)
    assert w.ttft_avg_s == pytest.approx(0.2)
    assert w.finished == 4.0
    assert w.generation_tokens_delta == 400.0
    assert w.generation_tokens_total == 1400.0


def test_no_new_requests_gives_none_not_zero():
    a = parse_metrics(scrape(100, 500.0, 100, 10.0))
    w = window(a, parse_metrics(scrape(100, 500.0, 100, 10.0)))
    assert w.e2e_avg_s is None
    assert w.ttft_avg_s is None
    assert w.finished == 0.0


def test_counter_reset_after_restart_takes_new_value_as_delta():
    before = parse_metrics(scrape(1000, 5000.0, gen=90000))
    after = parse_metrics(scrape(3, 4.5, gen=250))  # restarted: everything went down
    w = window(before, after)
    assert w.finished == 3.0
    assert w.e2e_avg_s == pytest.approx(1.5)
    assert w.generation_tokens_delta == 250.0


def test_restart_with_no_request_yet_is_none():
    w = window(parse_metrics(scrape(1000, 5000.0)), parse_metrics(scrape(0, 0.0)))
    assert w.e2e_avg_s is None
    assert w.finished == 0.0


def test_one_rank_restarts_other_keeps_counting():
    a = parse_metrics(scrape(50, 100.0, engine="0") + scrape(40, 80.0, engine="1").replace(
        "vllm:num_requests_waiting", "vllm:ignored"))
    b = parse_metrics(scrape(52, 104.0, engine="0") + scrape(2, 8.0, engine="1").replace(
        "vllm:num_requests_waiting", "vllm:ignored"))
    w = window(a, b)
    # rank 0: +2 requests, +4 s; rank 1 restarted: 2 requests, 8 s.
    assert w.finished == 4.0
    assert w.e2e_avg_s == pytest.approx(12.0 / 4)


def test_new_series_counts_fully():
    a = parse_metrics(scrape(10, 10.0, engine="0"))
    b = parse_metrics(scrape(10, 10.0, engine="0") + scrape(2, 6.0, engine="1").replace(
        "vllm:num_requests_waiting", "vllm:ignored"))
    assert window(a, b).e2e_avg_s == pytest.approx(3.0)


def test_dialect_change_means_no_earlier_scrape():
    a = parse_metrics("tgi_queue_size 1\ntgi_request_duration_sum 5\ntgi_request_duration_count 1\n")
    b = parse_metrics(scrape(10, 30.0))
    assert window(a, b).e2e_avg_s is None


def test_counter_delta_never_negative():
    assert counter_delta(10.0, 4.0) == 4.0
    assert counter_delta(None, 7.0) == 7.0
    assert counter_delta(3.0, 5.0) == 2.0
    assert counter_delta(3.0, -1.0) == 0.0


def test_hist_delta_missing_side_is_none():
    assert hist_delta(None, {}) is None
    assert hist_delta({}, None) is None


def test_a_counter_that_went_down_says_the_server_restarted():
    """``Window.restarted``: any counter or histogram count of both scrapes lower than
    before (the server began counting again); not for counters that grew or stayed, nor
    without an earlier scrape."""
    before = parse_metrics(scrape(1000, 5000.0, gen=90000))
    assert window(before, parse_metrics(scrape(3, 4.5, gen=250))).restarted
    # only the generated tokens went down (the histogram kept its count by chance)
    assert window(before, parse_metrics(scrape(1000, 5000.0, gen=10))).restarted
    assert not window(before, parse_metrics(scrape(1004, 5008.0, gen=90400))).restarted
    assert not window(before, parse_metrics(scrape(1000, 5000.0, gen=90000))).restarted
    assert not window(None, parse_metrics(scrape(3, 4.5, gen=250))).restarted
