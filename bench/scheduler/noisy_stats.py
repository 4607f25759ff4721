"""Figures of the ``noisy_tenant`` scenario (pure logic): per tenant goodput, TTFT,
429s and served tokens; Jain's fairness index over served tokens per window among the
backlogged tenants and the largest difference between two of them; Jain's index of
each tenant's served tokens over its max-min fair share.

Definitions (per window of ``window_s`` wall seconds, requests counted by the time
their answer ended; demand = tokens of the requests a tenant *sent* in the window):

- **backlogged**: a tenant whose demand in the window is at least an equal share of
  the tokens served in it (served total / tenants that sent anything): it asked for at
  least what a fair scheduler could give it.
- **Jain**: (sum x)^2 / (n x sum x^2) over the served tokens x of the backlogged
  tenants (1 = equal; 1/n = one tenant got everything; 1 with a single backlogged
  tenant).
- **max-min Jain**: the same over x_i = served_i / fair_i, fair_i the max-min fair
  share of tenant i (water-filling of the window's served total over the demands, by
  weight): below 1 when a tenant that asked for less than its share did not get what
  it asked for while another got more than its share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..common import percentile, rounded


@dataclass
class Outcome:
    """One request of the load."""

    tenant: str
    sent_s: float
    """Wall seconds from the run start."""
    status: int | None
    ok: bool
    ttft_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    """Prompt + output tokens served (0 unless ok)."""


def jain(xs: Sequence[float]) -> float | None:
    """Jain's fairness index of ``xs`` (None for an empty list; 1 when all are 0)."""
    if not xs:
        return None
    s, s2 = sum(xs), sum(x * x for x in xs)
    return 1.0 if s2 == 0 else s * s / (len(xs) * s2)


def max_min_shares(demand: dict[str, float], total: float,
                   weights: dict[str, float] | None = None) -> dict[str, float]:
    """Max-min fair split of ``total`` over ``demand`` (water-filling by weight): a tenant
    never gets more than it asked for; what it leaves goes to the others."""
    w = weights or {}
    left, active = total, {t for t, d in demand.items() if d > 0}
    share = {t: 0.0 for t in demand}
    while active and left > 1e-9:
        wsum = sum(w.get(t, 1.0) for t in active)
        unit = left / wsum
        done = {t for t in active if demand[t] - share[t] <= unit * w.get(t, 1.0)}
        if not done:
            for t in active:
                share[t] += unit * w.get(t, 1.0)
            break
        for t in done:
            left -= demand[t] - share[t]
            share[t] = demand[t]
        active -= done
    return share


def windows(outcomes: Sequence[Outcome], duration_s: float, window_s: float,
            tokens_per_request: dict[str, float]) -> list[dict]:
    """Per window: served and demanded tokens per tenant, the backlogged tenants, Jain,
    the largest served difference among them, and the max-min Jain."""
    out = []
    n = int(duration_s // window_s)
    for i in range(n):
        lo, hi = i * window_s, (i + 1) * window_s
        served: dict[str, float] = defaultdict(float)
        demand: dict[str, float] = defaultdict(float)
        for o in outcomes:
            if lo <= o.sent_s < hi:
                demand[o.tenant] += tokens_per_request.get(o.tenant, 0.0)
            if o.ok and o.end_s is not None and lo <= o.end_s < hi:
                served[o.tenant] += o.tokens
        tenants = sorted(demand)
        total = sum(served.values())
        if not tenants:
            continue
        equal = total / len(tenants)
        backlogged = [t for t in tenants if demand[t] >= equal]
        xs = [served[t] for t in backlogged]
        fair = max_min_shares({t: demand[t] for t in tenants}, total)
        norm = [served[t] / fair[t] for t in tenants if fair[t] > 0]
        out.append({"window": i, "served": {t: served[t] for t in tenants},
                    "backlogged": backlogged, "jain": jain(xs),
                    "max_diff": (max(xs) - min(xs)) if len(xs) > 1 else 0.0,
                    "maxmin_jain": jain(norm)})
    return out


def _done_in(outcomes: Sequence[Outcome], duration_s: float) -> int:
    """Requests answered OK before the load stopped (what the pool served under load;
    the backlog answered after it depends on the shedding, not on the throughput)."""
    return sum(1 for o in outcomes if o.ok and o.end_s is not None and o.end_s <= duration_s)


def summarise(outcomes: Sequence[Outcome], duration_s: float, window_s: float,
              tokens_per_request: dict[str, float]) -> dict:
    """The record of one run: ``tenants`` {name: {sent, ok, r429, errors, goodput_rps
    (answered OK while the load ran, per second),
    ttft_p50_s, ttft_p99_s, served_tokens}}, totals, and the window figures (worst
    window's Jain and max-min Jain, largest difference)."""
    by: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by[o.tenant].append(o)
    tenants = {}
    for t, os_ in sorted(by.items()):
        ttfts = [o.ttft_s for o in os_ if o.ok and o.ttft_s is not None]
        tenants[t] = {
            "sent": len(os_), "ok": sum(o.ok for o in os_),
            "r429": sum(o.status == 429 for o in os_),
            "errors": sum((not o.ok) and o.status != 429 for o in os_),
            "goodput_rps": rounded(_done_in(os_, duration_s) / duration_s, 3),
            "ttft_p50_s": rounded(percentile(ttfts, 50)),
            "ttft_p99_s": rounded(percentile(ttfts, 99)),
            "served_tokens": sum(o.tokens for o in os_),
        }
    ws = windows(outcomes, duration_s, window_s, tokens_per_request)
    jains = [w["jain"] for w in ws if w["jain"] is not None]
    mm = [w["maxmin_jain"] for w in ws if w["maxmin_jain"] is not None]
    return {
        "tenants": tenants,
        "goodput_rps": rounded(_done_in(outcomes, duration_s) / duration_s, 3),
        "served_tokens": sum(o.tokens for o in outcomes),
        "r429": sum(o.status == 429 for o in outcomes),
        "jain_min": rounded(min(jains)) if jains else None,
        "jain_mean": rounded(sum(jains) / len(jains)) if jains else None,
        "maxmin_jain_min": rounded(min(mm)) if mm else None,
        "max_backlogged_diff": max((w["max_diff"] for w in ws), default=0.0),
        "backlogged_per_window": [len(w["backlogged"]) for w in ws],
        "windows": len(ws),
    }
