"""Health score formula, renormalisation of missing terms, saturation, held values."""

from __future__ import annotations

import pytest

from controlplane.config import ScoringSettings
from controlplane.routing.scoring import LastKnown, ScoreInputs, compute_score

S = ScoringSettings()  # w_queue .5, w_kv .3, w_latency .2, queue_norm 16, latency_norm_s 30


def test_idle_node_scores_zero():
    r = compute_score(ScoreInputs(0, 0.0, 0.0), S)
    assert r.score == 0.0 and not r.saturated


def test_full_formula():
    r = compute_score(ScoreInputs(queue_depth=8, kv_cache_usage=0.5, e2e_avg_s=15.0), S)
    assert r.score == pytest.approx(0.5 * 0.5 + 0.3 * 0.5 + 0.2 * 0.5)
    assert r.terms == {"q": 0.5, "kv": 0.5, "lat": 0.5}


def test_terms_are_capped_at_one():
    r = compute_score(ScoreInputs(queue_depth=1000, kv_cache_usage=1.0, e2e_avg_s=999.0), S)
    assert r.score == pytest.approx(1.0)


def test_weight_divides_the_score():
    one = compute_score(ScoreInputs(8, 0.5, 15.0), S, weight=1.0).score
    two = compute_score(ScoreInputs(8, 0.5, 15.0), S, weight=2.0).score
    assert two == pytest.approx(one / 2)


def test_missing_kv_renormalises():
    # TGI: no KV gauge. q = 0.5, lat = 1.0 -> (0.5*0.5 + 0.2*1.0) / 0.7
    r = compute_score(ScoreInputs(queue_depth=8, e2e_avg_s=60.0), S)
    assert r.score == pytest.approx((0.25 + 0.2) / 0.7)
    assert set(r.terms) == {"q", "lat"}


def test_missing_latency_renormalises():
    r = compute_score(ScoreInputs(queue_depth=16, kv_cache_usage=0.0), S)
    assert r.score == pytest.approx(0.5 / 0.8)


def test_no_terms_gives_none():
    r = compute_score(ScoreInputs(), S)
    assert r.score is None and not r.saturated and r.terms == {}


def test_zero_weight_terms_are_ignored():
    s = ScoringSettings(w_queue=0.0, w_kv=1.0, w_latency=0.0)
    assert compute_score(ScoreInputs(16, 0.25, 30.0), s).score == pytest.approx(0.25)
    assert compute_score(ScoreInputs(queue_depth=16), s).score is None


@pytest.mark.parametrize("inputs,saturated", [
    (ScoreInputs(queue_depth=31.9, kv_cache_usage=0.5), False),
    (ScoreInputs(queue_depth=32), True),
    (ScoreInputs(kv_cache_usage=0.98), True),
    (ScoreInputs(kv_cache_usage=0.97), False),
    (ScoreInputs(), False),
])
def test_saturation(inputs, saturated):
    assert compute_score(inputs, S).saturated is saturated


def test_last_known_holds_then_drops():
    lk = LastKnown(hold_s=5.0)
    assert lk.fill(ScoreInputs(4, 0.3, 2.0), now=100.0) == ScoreInputs(4, 0.3, 2.0)
    # Latency missing (no request finished): held for 5 s.
    assert lk.fill(ScoreInputs(4, 0.3, None), now=103.0) == ScoreInputs(4, 0.3, 2.0)
    assert lk.fill(ScoreInputs(4, 0.3, None), now=105.0) == ScoreInputs(4, 0.3, 2.0)
    # Too old: dropped, and stays dropped.
    assert lk.fill(ScoreInputs(4, 0.3, None), now=105.1) == ScoreInputs(4, 0.3, None)
    assert lk.fill(ScoreInputs(4, 0.3, None), now=105.2) == ScoreInputs(4, 0.3, None)
    # A new value is recorded again.
    assert lk.fill(ScoreInputs(None, None, 1.0), now=106.0) == ScoreInputs(4, 0.3, 1.0)
