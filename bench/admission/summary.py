"""Figures of one run (pure): counts and rates of the outcomes, latency of the admitted
requests, goodput.

- rates are fractions (0-1) of the requests sent;
- *admitted* = every request that was not shed (it went on to a node, or waited for
  one): its latency counts even when it timed out, so a p99 at or above the deadline
  means the tail of the admitted requests timed out;
- latencies in wall seconds; goodput = ``ok`` answers per wall second from the first
  request sent to the last answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..common import percentile, rounded
from .loadgen import Result

OUTCOMES = ("ok", "shed", "timeout", "error")


def summarise(results: Sequence[Result], wall_s: float, deadline_s: float) -> dict:
    """The record of one run; ``wall_s``: seconds from the first send to the last answer.

    Raises ``ValueError`` for a non-positive duration or deadline."""
    if wall_s <= 0 or deadline_s <= 0:
        raise ValueError("duration and deadline must be > 0")
    n = len(results)
    counts = {o: sum(1 for r in results if r.outcome == o) for o in OUTCOMES}
    admitted = [r.latency_s for r in results if r.outcome != "shed"]
    ok = [r.latency_s for r in results if r.outcome == "ok"]
    shed = [r.latency_s for r in results if r.outcome == "shed"]
    p99 = percentile(admitted, 99)
    errors = [r.error for r in results if r.outcome == "error" and r.error]

    def rate(k: str) -> float:
        return round(counts[k] / n, 4) if n else 0.0

    return {
        "requests": n,
        "ok": counts["ok"],
        "shed": counts["shed"],
        "timeouts": counts["timeout"],
        "errors": counts["error"],
        "admitted": len(admitted),
        "timeout_rate": rate("timeout"),
        "shed_rate": rate("shed"),
        "error_rate": rate("error"),
        "p50_s": rounded(percentile(admitted, 50), 3),
        "p99_s": rounded(p99, 3),
        "max_s": rounded(max(admitted), 3) if admitted else None,
        "ok_p99_s": rounded(percentile(ok, 99), 3),
        "shed_p99_s": rounded(percentile(shed, 99), 3),
        "goodput_rps": round(counts["ok"] / wall_s, 3),
        "p99_under_deadline": p99 is not None and p99 < deadline_s,
        "send_lag_p99_s": rounded(percentile([r.lag_s for r in results], 99), 3),
        "error_samples": sorted(set(errors))[:3],
    }
