"""Hysteresis: K failures -> unhealthy, M successes -> healthy again."""

from __future__ import annotations

from controlplane.routing.health import HealthTracker


def run(t: HealthTracker, polls: str) -> list[tuple[bool, bool]]:
    """Feed '+' (good) / '-' (failed) polls; return (healthy, changed) after each."""
    out = []
    for c in polls:
        changed = t.observe(c == "+")
        out.append((t.healthy, changed))
    return out


def test_starts_healthy():
    assert HealthTracker().healthy


def test_k_failures_to_go_down_m_successes_to_come_back():
    t = HealthTracker(unhealthy_after=3, healthy_after=2)
    assert run(t, "---") == [(True, False), (True, False), (False, True)]
    assert t.consecutive_failures == 3
    assert run(t, "-+") == [(False, False), (False, False)]
    assert run(t, "+") == [(True, True)]
    assert t.consecutive_successes == 2 and t.consecutive_failures == 0


def test_interrupted_runs_reset_the_count():
    t = HealthTracker(unhealthy_after=3, healthy_after=2)
    run(t, "--+--+--+")
    assert t.healthy
    run(t, "---")
    run(t, "+-+-+-")
    assert not t.healthy


def test_no_event_while_state_holds():
    t = HealthTracker(unhealthy_after=2, healthy_after=2)
    changes = [c for _, c in run(t, "++++--------++++")]
    assert changes.count(True) == 2


def test_thresholds_below_one_read_as_one():
    t = HealthTracker(unhealthy_after=0, healthy_after=0)
    assert run(t, "-+") == [(False, True), (True, True)]
