"""The figures of the noisy_tenant benchmark (bench/scheduler/noisy_stats.py): Jain's
index, the max-min fair split and the per-window backlogged tenants."""

from __future__ import annotations

import pytest

from bench.scheduler.noisy import arrivals, targets
from bench.scheduler.noisy_stats import Outcome, jain, max_min_shares, summarise


def test_jain_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain([5, 5, 5, 5]) == 1.0
    assert jain([8, 0, 0, 0]) == pytest.approx(0.25)
    assert jain([]) is None


def test_max_min_gives_small_demands_in_full_and_splits_the_rest() -> None:
    share = max_min_shares({"q": 10, "r": 10, "noisy": 500}, 100)
    assert share == {"q": 10, "r": 10, "noisy": 80}
    assert max_min_shares({"a": 100, "b": 100}, 100) == {"a": 50, "b": 50}
    assert max_min_shares({"a": 100, "b": 100}, 90, {"a": 2}) == {"a": 60, "b": 30}


def _ok(tenant: str, sent: float, end: float, tokens: int = 10) -> Outcome:
    return Outcome(tenant=tenant, sent_s=sent, status=200, ok=True, ttft_s=0.1, end_s=end,
                   tokens=tokens)


def test_windows_count_backlogged_tenants_and_a_short_changed_quiet_one() -> None:
    outs = [_ok("noisy", 0.1 * i, 0.1 * i + 0.5) for i in range(80)]       # asks 80 x 10
    outs += [_ok("a", 1.0 * i, 1.0 * i + 0.5) for i in range(9)]           # asks 9 x 10
    outs += [Outcome("b", 0.5 + i, 429, False) for i in range(9)]          # asks 9, gets none
    rec = summarise(outs, 10.0, 10.0, {"noisy": 10, "a": 10, "b": 10})
    assert rec["tenants"]["b"]["r429"] == 9 and rec["tenants"]["a"]["ok"] == 9
    assert rec["backlogged_per_window"] == [1]          # only the noisy tenant asked for more
    assert rec["jain_min"] == 1.0 and rec["max_backlogged_diff"] == 0
    assert rec["maxmin_jain_min"] < 0.9                 # b asked for its share, got nothing


def test_the_load_is_seeded_and_the_noisy_tenant_sends_ten_times_more() -> None:
    load = arrivals(2.0, 100.0, True)
    assert load == arrivals(2.0, 100.0, True)
    n = sum(1 for _, t in load if t == "noisy")
    q = sum(1 for _, t in load if t == "q1")
    assert n / q == pytest.approx(10, rel=0.02)


def test_targets_are_ratios_within_the_run() -> None:
    def rec(p99: float, goodput: float) -> dict:
        return {"goodput_rps": goodput,
                "tenants": {t: {"ttft_p99_s": p99} for t in ("q1", "q2", "q3", "q4")}}

    lines = targets({"baseline": rec(0.2, 8), "fair_on": rec(0.3, 19), "fair_off": rec(2.0, 20)})
    assert "fair_on: quiet TTFT p99 / baseline = 1.50" in lines[0]
    assert any("goodput / fair_off = 0.95" in ln for ln in lines)
