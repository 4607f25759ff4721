"""Deltas between two scrapes: recent latency from histogram totals, token counts from
counters, with restarts handled.

Prometheus counters and histogram ``_sum``/``_count`` only grow while a server runs.
A value lower than the previous one means the server (or one engine rank) restarted
and its counters began again from zero: the new value is then the whole delta for
that series -- never a negative one. Deltas are taken *per series* and then summed,
so one data-parallel rank restarting does not hide the others' traffic. A series
absent from the previous scrape (a new rank or model) contributes its full value.

Recent mean latency = sum of ``_sum`` deltas / sum of ``_count`` deltas (seconds per
request). No request finished between the scrapes -> ``None``, not 0: an idle node
has no recent latency, it does not have a zero one.
"""

from __future__ import annotations

import math

from controlplane.routing.nodemetrics.model import HistTotals, Reading, Window
from controlplane.routing.nodemetrics.prom import SeriesKey


def counter_delta(prev: float | None, cur: float) -> float:
    """Increase of one counter series; ``cur`` itself after a reset (``cur < prev``)
    or when the series is new (``prev is None``). Never negative."""
    if prev is None or cur < prev:
        return max(cur, 0.0)
    return cur - prev


def counters_delta(prev: dict[SeriesKey, float] | None,
                   cur: dict[SeriesKey, float] | None) -> float | None:
    """Summed per-series increase; ``None`` when either scrape lacks the counter."""
    if prev is None or cur is None:
        return None
    return math.fsum(counter_delta(prev.get(k), v) for k, v in cur.items())


def hist_delta(prev: dict[SeriesKey, HistTotals] | None,
               cur: dict[SeriesKey, HistTotals] | None) -> tuple[float, float] | None:
    """``(sum delta, count delta)`` over every series; ``None`` without both scrapes.

    A series whose count or sum went down restarted: its current totals are the delta."""
    if prev is None or cur is None:
        return None
    ds = dc = 0.0
    for key, c in cur.items():
        p = prev.get(key)
        if p is None or c.count < p.count or c.sum < p.sum:
            ds += max(c.sum, 0.0)
            dc += max(c.count, 0.0)
        else:
            ds += c.sum - p.sum
            dc += c.count - p.count
    return ds, dc


def _avg(delta: tuple[float, float] | None) -> float | None:
    if delta is None:
        return None
    s, c = delta
    if c <= 0:
        return None
    return max(s, 0.0) / c


def _total(v: dict[SeriesKey, float] | None) -> float | None:
    return math.fsum(v.values()) if v else None


def window(prev: Reading | None, cur: Reading) -> Window:
    """What ``cur`` says about the time since ``prev`` (same node, earlier scrape).

    ``prev`` of another dialect (the server behind the address changed) counts as no
    earlier scrape. The JSON dialect carries its own average (``avg_latency_seconds``),
    used as is."""
    if prev is not None and prev.dialect != cur.dialect:
        prev = None
    out = Window(prompt_tokens_total=_total(cur.prompt_tokens),
                 generation_tokens_total=_total(cur.generation_tokens))
    if cur.dialect == "json":
        out.e2e_avg_s = cur.e2e_avg_s_direct
        return out
    if prev is None:
        return out
    e2e = hist_delta(prev.e2e, cur.e2e)
    out.e2e_avg_s = _avg(e2e)
    out.finished = e2e[1] if e2e is not None else None
    out.ttft_avg_s = _avg(hist_delta(prev.ttft, cur.ttft))
    out.prompt_tokens_delta = counters_delta(prev.prompt_tokens, cur.prompt_tokens)
    out.generation_tokens_delta = counters_delta(prev.generation_tokens, cur.generation_tokens)
    out.progress_delta = counters_delta(prev.progress, cur.progress)
    out.restarted = (_went_down(prev.prompt_tokens, cur.prompt_tokens)
                     or _went_down(prev.generation_tokens, cur.generation_tokens)
                     or _went_down(prev.progress, cur.progress)
                     or _went_down(_counts(prev.e2e), _counts(cur.e2e)))
    return out


def _counts(h: dict[SeriesKey, HistTotals] | None) -> dict[SeriesKey, float] | None:
    return None if h is None else {k: v.count for k, v in h.items()}


def _went_down(prev: dict[SeriesKey, float] | None, cur: dict[SeriesKey, float] | None) -> bool:
    """Whether a series of both scrapes is lower in ``cur``: a counter that began again."""
    if not prev or not cur:
        return False
    return any(k in prev and v < prev[k] for k, v in cur.items())
