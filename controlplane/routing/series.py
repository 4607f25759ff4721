"""The pool's traffic over time: the time series behind the admin overview.

Writer: the leader control plane calls :meth:`SeriesRecorder.maybe_record` every poll
cycle. At most every :data:`STEP_S` seconds it turns the cumulative counters the edges
report (``infergate:v1:edges``: per node ``requests``/``failures``/``inflight``/
``latency_ewma_ms``, the ``admission`` counters and the ``duration`` histogram) and the
cache counters (``infergate:v1:cache:stats``) into the increase since its previous point
and pushes one compact JSON point onto ``keynames.OVERVIEW_SERIES`` (a list, newest
first, ``LTRIM`` to :data:`MAX_POINTS`, TTL :data:`TTL_S`: cache-kind data that may be
lost at any time). The previous counters are kept in memory, so the first cycle of a
new leader only takes a baseline. A counter that went down (an nginx restart) counts
from zero (its current value is the increase); an edge or node seen for the first time
is a baseline.

A point (all counts are increases over ``dt`` seconds ending at ``ts``)::

    {"ts": 1764430000.5, "dt": 5.0, "edges": 2,
     "requests": 120,            # requests finished at the edges: every answer (node,
                                 # cache hit, 4xx/5xx of the edge), from the histogram
     "lookups": 80, "hits_exact": 20, "hits_semantic": 4, "misses": 56, "bypass": 1,
     "shed": 0, "rate_limited": 3, "deadline_exceeded": 0, "auth_rejected": 0,
     "proxied": 96, "failures": 2,     # sums over the nodes below
     "h": [0, 3, 10, ...],       # duration histogram increase per bucket (trailing zeros cut)
     "le": [...],                # only when the edges' bucket bounds differ from DEFAULT_LE
     "nodes": {"sim-a": {"requests": 50, "failures": 1, "inflight": 2,
                         "latency_ms": 850.0}}}   # latency: mean edge EWMA now, null = none

Reader: :func:`read` turns the points of a window into evenly spaced slots of rates for
charts, plus totals over the window. Pure helpers (:func:`quantile`, :func:`increase`)
have no I/O.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis

from controlplane.redisdb import keynames

STEP_S = 5.0
"""At most one point per this many seconds (a point is written on the first poll cycle
after it)."""
KEEP_S = 3600.0
"""The longest window the overview shows (60 min)."""
MAX_POINTS = int(KEEP_S / STEP_S) + 24
"""List cap (LTRIM): a little over KEEP_S of points."""
TTL_S = int(2 * KEEP_S)
"""TTL of the list, renewed with every point: it goes away when no leader writes."""
DEFAULT_LE: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                 30, 60, 120)
"""Upper bounds (s) of the edge's duration histogram (``lua/infergate/core/prometheus.lua``)."""
WINDOWS_S: tuple[int, ...] = (300, 3600)
"""Windows the overview offers: 5 and 60 minutes."""
MAX_SLOTS = 120
"""A window is drawn in at most this many slots (5 s slots for 5 min, 30 s for 60 min)."""
ADMISSION_FIELDS = ("shed", "rate_limited", "deadline_exceeded", "auth_rejected")
CACHE_FIELDS = ("lookups", "hits_exact", "hits_semantic", "misses", "bypass")


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _count(v: object) -> int:
    n = _num(v)
    return int(n) if n is not None and n > 0 else 0


def increase(cur: int, prev: int | None) -> int:
    """Increase of a cumulative counter: ``cur - prev``; ``cur`` when the counter went
    down (restarted from zero); 0 without a previous value (baseline)."""
    if prev is None:
        return 0
    return cur - prev if cur >= prev else cur


def quantile(q: float, counts: Sequence[int], le: Sequence[float] = DEFAULT_LE) -> float | None:
    """The ``q`` quantile (0-1) in seconds of a histogram with ``counts[i]`` observations
    in bucket ``(le[i-1], le[i]]`` (``counts`` has one more bucket, +Inf, at the end),
    interpolated linearly inside the bucket like Prometheus' ``histogram_quantile``.
    Observations in +Inf give the highest finite bound. ``None`` for no observation."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    cum = 0
    for i, c in enumerate(counts):
        if c > 0 and cum + c >= rank:
            if i >= len(le):
                return float(le[-1])
            lo = float(le[i - 1]) if i > 0 else 0.0
            return lo + (float(le[i]) - lo) * max(rank - cum, 0.0) / c
        cum += c
    return float(le[-1])


@dataclass
class _EdgeCounters:
    nodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    admission: dict[str, int] = field(default_factory=dict)
    hist: list[int] | None = None
    le: tuple[float, ...] = DEFAULT_LE


def _parse_edge(doc: Mapping) -> _EdgeCounters:
    out = _EdgeCounters()
    nodes = doc.get("nodes")
    if isinstance(nodes, dict):
        for name, st in nodes.items():
            if isinstance(st, dict):
                out.nodes[str(name)] = (_count(st.get("requests")), _count(st.get("failures")))
    adm = doc.get("admission")
    if isinstance(adm, dict):
        out.admission = {f: _count(adm.get(f)) for f in ADMISSION_FIELDS}
    dur = doc.get("duration")
    if isinstance(dur, dict) and isinstance(dur.get("counts"), list):
        le = dur.get("le")
        if isinstance(le, list) and le and all(_num(x) is not None for x in le):
            out.le = tuple(float(x) for x in le)
        counts = [_count(c) for c in dur["counts"]]
        if len(counts) == len(out.le) + 1:
            out.hist = counts
    return out


def _live_doc(raw: str, now: float, stale_s: float) -> dict | None:
    """An edge's JSON document, or None when it does not parse or its ``ts`` is missing
    or older than ``stale_s`` seconds."""
    try:
        doc = json.loads(raw)
    except (TypeError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    ts = _num(doc.get("ts"))
    if ts is None or now - ts > stale_s:
        return None
    return doc


def _add_gauges(nodes: dict[str, dict], lat: dict[str, list[float]], doc: Mapping) -> None:
    """Add an edge's in-flight requests per node to ``nodes`` and its latency EWMAs to
    ``lat`` (node -> values, averaged later)."""
    for name, st in (doc.get("nodes") or {}).items():
        if not isinstance(st, dict):
            continue
        n = nodes.setdefault(str(name), {"requests": 0, "failures": 0, "inflight": 0,
                                         "latency_ms": None})
        n["inflight"] += _count(st.get("inflight"))
        ms = _num(st.get("latency_ewma_ms"))
        if ms is not None:
            lat.setdefault(str(name), []).append(ms)


def _add_increases(p: dict, nodes: dict[str, dict], cur: _EdgeCounters,
                   prev: _EdgeCounters) -> None:
    """Add an edge's increases since ``prev`` of the node requests and failures (to
    ``nodes`` and the point's totals) and of the admission counters to the point ``p``."""
    for name, (req, fail) in cur.nodes.items():
        before = prev.nodes.get(name)
        if before is None:
            continue
        dreq, dfail = increase(req, before[0]), increase(fail, before[1])
        nodes[name]["requests"] += dreq
        nodes[name]["failures"] += dfail
        p["proxied"] += dreq
        p["failures"] += dfail
    for f in ADMISSION_FIELDS:
        if f in cur.admission and f in prev.admission:
            p[f] += increase(cur.admission[f], prev.admission[f])


def _add_hist(hist: list[int] | None, le: tuple[float, ...], cur: _EdgeCounters,
              prev: _EdgeCounters) -> tuple[list[int] | None, tuple[float, ...]]:
    """(the summed duration histogram, its bounds) with an edge's increase since
    ``prev`` added (all of it when the edge restarted); the first edge's bounds are
    kept, an edge with other bounds is left out."""
    if cur.hist is not None and prev.hist is not None and cur.le == prev.le:
        if hist is None:
            hist, le = [0] * len(cur.hist), cur.le
        if cur.le == le:
            restarted = sum(cur.hist) < sum(prev.hist)
            for i, c in enumerate(cur.hist):
                hist[i] += c if restarted else max(c - prev.hist[i], 0)
    return hist, le


def _finish_point(p: dict, hist: list[int] | None, le: tuple[float, ...],
                  nodes: dict[str, dict]) -> None:
    """The point's ``requests``, histogram (``h``, trailing empty buckets cut; ``le``
    when not the default) and ``nodes``."""
    if hist is not None:
        p["requests"] = sum(hist)
        while hist and hist[-1] == 0:
            hist.pop()
        p["h"] = hist
        if le != DEFAULT_LE:
            p["le"] = list(le)
    else:  # edges without the histogram: what reached a node, the cache or a refusal
        p["requests"] = (p["proxied"] + p["hits_exact"] + p["hits_semantic"] + p["shed"]
                         + p["rate_limited"] + p["auth_rejected"])
    p["nodes"] = nodes


class SeriesRecorder:
    """Keeps the previous cumulative counters and writes one point per :data:`STEP_S`.
    Not thread-safe; the control plane calls it from its (locked) cycle."""

    def __init__(self, stale_s: float, step_s: float = STEP_S):
        self.stale_s = stale_s
        """Edge entries whose ``ts`` is older than this many seconds are left out."""
        self.step_s = step_s
        self.last_ts: float | None = None
        self._edges: dict[str, _EdgeCounters] = {}
        self._cache: dict[str, int] | None = None

    def reset(self) -> None:
        """Forget the previous counters: the next call takes a baseline (e.g. after
        leadership moved away and back)."""
        self.last_ts = None
        self._edges = {}
        self._cache = None

    def due(self, now: float) -> bool:
        return self.last_ts is None or now - self.last_ts >= self.step_s

    def point(self, raw_edges: Mapping[str, str], raw_cache: Mapping[str, str],
              now: float) -> dict | None:
        """The point for the interval since the previous call from the edges' hash
        (edge id -> JSON) and the cache counters hash; ``None`` on the first call
        (baseline). Updates the remembered counters."""
        first = self.last_ts is None
        dt = 0.0 if first else now - (self.last_ts or now)
        p: dict = {"ts": round(now, 3), "dt": round(dt, 3), "edges": 0, "requests": 0,
                   **{f: 0 for f in CACHE_FIELDS}, **{f: 0 for f in ADMISSION_FIELDS},
                   "proxied": 0, "failures": 0}
        hist: list[int] | None = None
        le = DEFAULT_LE
        nodes: dict[str, dict] = {}
        lat: dict[str, list[float]] = {}
        seen: dict[str, _EdgeCounters] = {}
        for edge_id, raw in raw_edges.items():
            doc = _live_doc(raw, now, self.stale_s)
            if doc is None:
                continue
            cur = _parse_edge(doc)
            prev = self._edges.get(edge_id)
            seen[edge_id] = cur
            p["edges"] += 1
            _add_gauges(nodes, lat, doc)
            if prev is None:
                continue
            _add_increases(p, nodes, cur, prev)
            hist, le = _add_hist(hist, le, cur, prev)
        for name, vals in lat.items():
            nodes[name]["latency_ms"] = round(sum(vals) / len(vals), 1)
        self._edges = seen
        cache = {f: _count(_num_text(raw_cache.get(f))) for f in CACHE_FIELDS}
        if self._cache is not None:
            for f in CACHE_FIELDS:
                p[f] = increase(cache[f], self._cache[f])
        self._cache = cache
        self.last_ts = now
        if first:
            return None
        _finish_point(p, hist, le, nodes)
        return p

    def maybe_record(self, r: redis.Redis, raw_edges: Mapping[str, str], now: float) -> dict | None:
        """When :meth:`due`: read the cache counters, compute the point and push it
        (LPUSH + LTRIM + EXPIRE, one round trip). Returns the point written, or ``None``.
        Raises ``redis.exceptions.RedisError`` (the caller logs it; the next call takes a
        new baseline for the cache counters only if this one never read them)."""
        if not self.due(now):
            return None
        raw_cache = r.hgetall(keynames.CACHE_STATS) or {}
        p = self.point(raw_edges, raw_cache, now)
        if p is None:
            return None
        pipe = r.pipeline(transaction=False)
        pipe.lpush(keynames.OVERVIEW_SERIES, json.dumps(p, separators=(",", ":")))
        pipe.ltrim(keynames.OVERVIEW_SERIES, 0, MAX_POINTS - 1)
        pipe.expire(keynames.OVERVIEW_SERIES, TTL_S)
        pipe.execute()
        return p


def _num_text(v: object) -> float | None:
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return _num(v)


# ---- reading -----------------------------------------------------------------------


def _rate(n: float, d: float) -> float | None:
    return round(n / d, 4) if d > 0 else None


def _share(n: float, d: float) -> float | None:
    return round(n / d, 4) if d > 0 else None


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def _summary(points: list[dict]) -> dict:
    """Totals of a group of points (sums of counts, merged histogram)."""
    t: dict = {"requests": 0, **{f: 0 for f in CACHE_FIELDS},
               **{f: 0 for f in ADMISSION_FIELDS}, "proxied": 0, "failures": 0}
    dt = 0.0
    hist: list[int] = []
    le: Sequence[float] = DEFAULT_LE
    for p in points:
        dt += _num(p.get("dt")) or 0.0
        for f in t:
            t[f] += _count(p.get(f))
        h = p.get("h")
        if isinstance(h, list):
            ple = p.get("le") if isinstance(p.get("le"), list) else DEFAULT_LE
            if not hist:
                le = ple
                hist = [0] * (len(le) + 1)
            if list(ple) == list(le):
                for i, c in enumerate(h[:len(hist)]):
                    hist[i] += _count(c)
    hits = t["hits_exact"] + t["hits_semantic"]
    p50, p99 = quantile(0.5, hist, le), quantile(0.99, hist, le)
    return {
        **t, "seconds": round(dt, 3),
        "rps": _rate(t["requests"], dt),
        "hit_rate": _share(hits, t["lookups"]),
        "hit_rate_exact": _share(t["hits_exact"], t["lookups"]),
        "hit_rate_semantic": _share(t["hits_semantic"], t["lookups"]),
        "p50_ms": _ms(p50), "p99_ms": _ms(p99),
        "shed_rps": _rate(t["shed"], dt), "rate_limited_rps": _rate(t["rate_limited"], dt),
        "shed_share": _share(t["shed"], t["requests"]),
        "rate_limited_share": _share(t["rate_limited"], t["requests"]),
        "error_rate": _share(t["failures"], t["proxied"]),
        "errors_rps": _rate(t["failures"], dt),
    }


def _node_summary(points: list[dict], name: str) -> dict:
    req = fail = 0
    dt = 0.0
    lat = inflight = None
    for p in points:
        dt += _num(p.get("dt")) or 0.0
        n = (p.get("nodes") or {}).get(name)
        if isinstance(n, dict):
            req += _count(n.get("requests"))
            fail += _count(n.get("failures"))
            if _num(n.get("latency_ms")) is not None:
                lat = _num(n.get("latency_ms"))
            inflight = _count(n.get("inflight"))
    return {"requests": req, "failures": fail, "seconds": round(dt, 3),
            "rps": _rate(req, dt), "error_rate": _share(fail, req),
            "latency_ms": lat, "inflight": inflight}


SERIES_FIELDS = ("rps", "hit_rate", "hit_rate_exact", "hit_rate_semantic", "p50_ms", "p99_ms",
                 "shed_rps", "rate_limited_rps", "error_rate", "errors_rps")
NODE_SERIES_FIELDS = ("rps", "error_rate", "latency_ms", "inflight")


def load_points(r: redis.Redis, window_s: float, now: float) -> list[dict]:
    """The points of the last ``window_s`` seconds, oldest first (one LRANGE)."""
    n = min(int(window_s / STEP_S) + 4, MAX_POINTS)
    out = []
    for raw in reversed(r.lrange(keynames.OVERVIEW_SERIES, 0, n - 1) or []):
        try:
            p = json.loads(raw)
        except ValueError:
            continue
        ts = _num(p.get("ts")) if isinstance(p, dict) else None
        if ts is not None and now - window_s < ts <= now + 1:
            out.append(p)
    return out


def overview(points: list[dict], window_s: float, now: float) -> dict:
    """The overview of ``points`` (oldest first) over ``window_s`` seconds ending ``now``.

    Returns::

        {"ts": now, "window_s": 300, "slot_s": 5.0, "points": 57,
         "series": {"ts": [slot end, epoch s], "rps": [...], "hit_rate": [...],
                    "hit_rate_exact", "hit_rate_semantic", "p50_ms", "p99_ms",
                    "shed_rps", "rate_limited_rps", "error_rate", "errors_rps"},
         "totals": {"requests", "rps", "lookups", "hits_exact", "hits_semantic", "misses",
                    "bypass", "hit_rate", "hit_rate_exact", "hit_rate_semantic",
                    "p50_ms", "p99_ms", "shed", "shed_rps", "shed_share", "rate_limited",
                    "rate_limited_rps", "rate_limited_share", "deadline_exceeded",
                    "auth_rejected", "proxied", "failures", "error_rate", "errors_rps",
                    "seconds"},
         "nodes": {"sim-a": {"series": {"ts", "rps", "error_rate", "latency_ms",
                                        "inflight"},
                             "totals": {"requests", "failures", "rps", "error_rate",
                                        "latency_ms", "inflight", "seconds"}}}}

    Units: ``*_rps`` per second, ``*_rate`` / ``*_share`` 0-1 (hit rate = hits / lookups,
    error rate = node failures / requests proxied to nodes, shares of all requests),
    ``*_ms`` milliseconds. Each series has one value per slot (``slot_s`` = window /
    :data:`MAX_SLOTS`, at least :data:`STEP_S`), ``null`` where no point fell or the figure has no
    denominator (no lookup, no request)."""
    slot_s = max(STEP_S, window_s / min(MAX_SLOTS, max(int(window_s / STEP_S), 1)))
    nslots = max(int(math.ceil(window_s / slot_s)), 1)
    start = now - nslots * slot_s
    groups: list[list[dict]] = [[] for _ in range(nslots)]
    for p in points:
        k = int((float(p["ts"]) - start) // slot_s)
        if 0 <= k < nslots:
            groups[k].append(p)
        elif k == nslots:
            groups[-1].append(p)
    # A point covers the interval (ts - dt, ts]. Points are written every STEP_S or a
    # little later (the poll cycle), so a slot can fall between two points; it then takes
    # the point whose interval covers it rather than reading as a gap.
    for k in range(nslots - 1):
        if groups[k]:
            continue
        nxt = next((g for g in groups[k + 1:] if g), None)
        if nxt:
            first = min(nxt, key=lambda q: float(q["ts"]))
            if float(first["ts"]) - float(first.get("dt") or 0) <= start + k * slot_s + 1e-6:
                groups[k] = [first]
    names = sorted({n for p in points for n in (p.get("nodes") or {})})
    series: dict[str, list] = {"ts": [round(start + (k + 1) * slot_s, 3) for k in range(nslots)]}
    for f in SERIES_FIELDS:
        series[f] = []
    nseries = {n: {"ts": series["ts"], **{f: [] for f in NODE_SERIES_FIELDS}} for n in names}
    for g in groups:
        s = _summary(g) if g else {}
        for f in SERIES_FIELDS:
            series[f].append(s.get(f))
        for n in names:
            ns = _node_summary(g, n) if g else {}
            for f in NODE_SERIES_FIELDS:
                nseries[n][f].append(ns.get(f))
    return {"ts": round(now, 3), "window_s": window_s, "slot_s": round(slot_s, 3),
            "points": len(points), "series": series, "totals": _summary(points),
            "nodes": {n: {"series": nseries[n], "totals": _node_summary(points, n)}
                      for n in names}}


def read(r: redis.Redis, window_s: float, now: float | None = None) -> dict:
    """:func:`overview` of the stored points of the last ``window_s`` seconds.
    Raises ``redis.exceptions.RedisError`` when Redis is unreachable."""
    now = time.time() if now is None else now
    return overview(load_points(r, window_s, now), window_s, now)
