"""One merged view per node: registry + state + latest metrics + edge stats + snapshot.

Sources (docs/internals.md): ``infergate:v1:nodes``,
``infergate:v1:node_states:{infergate:v1:nodes}``, ``infergate:v1:node:{name}:metrics``
(:class:`~controlplane.routing.wire.NodeMetricsDoc`),
``infergate:v1:node:{name}:history``, ``infergate:v1:edges``
(:class:`~controlplane.routing.wire.EdgeReport`; reports older than
``wire.EDGE_FRESH_FACTOR`` x ``edge.stale_after_s`` are ignored) and
``infergate:v1:routing`` (:class:`~controlplane.routing.wire.RoutingSnapshot`, for
``effective_weight``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import redis

from controlplane.config import Settings
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.routing.poller import REFUSED_TEXT
from controlplane.routing.wire import (
    BREAKER_STATES,
    NodeMetricsDoc,
    RoutingSnapshot,
    edge_fresh_s,
    fresh_edge_reports,
)

BREAKER_RANK = {b: len(BREAKER_STATES) - i for i, b in enumerate(BREAKER_STATES)}
"""open 3 > half_open 2 > closed 1: the worst breaker over the edges is shown."""
HISTORY_WINDOW_S = 300.0
"""Sparklines cover the last 5 minutes of history points."""


@dataclass
class EdgeAgg:
    """A node's edge stats summed over the fresh edge entries."""

    edges: int = 0
    """How many fresh edges report this node."""
    inflight: int = 0
    requests: int = 0
    """Requests proxied to the node since each edge started (cumulative)."""
    failures: int = 0
    breaker: str | None = None
    """Worst breaker over the edges: open > half_open > closed; ``None`` = no edge data."""
    breakers: dict[str, str] = field(default_factory=dict)
    """edge id -> breaker state."""
    latency_ewma_ms: float | None = None
    """Mean of the edges' latency EWMA (ms)."""


@dataclass
class NodeView:
    """What the nodes page and ``GET /api/v1/nodes`` show for one node.

    Units: seconds for ``*_s``, epoch seconds for ``*_ts``/``since``, 0-1 for
    ``kv_cache_usage`` and ``error_rate``. ``None`` means unknown (no fresh data)."""

    name: str
    url: str
    kind: str
    weight: float
    max_concurrency: int
    metrics_path: str
    health_path: str
    state: str
    """active | draining | drained (the registry state)."""
    state_since: float | None
    """When the state last changed (epoch s); ``None`` when it never did."""
    state_actor: str
    healthy: bool | None
    """Health after hysteresis from the latest poll; ``None`` = never polled / expired."""
    status: str
    """For display: ``draining`` / ``drained`` when so; for an active node ``active``,
    ``down`` (unhealthy), ``stalled`` (an edge found it
    stalled: requests in flight, no byte from it; :mod:`controlplane.routing.stall`) or ``unknown`` (never polled, or metrics expired)."""
    reachable: bool | None = None
    dialect: str | None = None
    score: float | None = None
    saturated: bool | None = None
    queue_depth: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    ttft_avg_s: float | None = None
    e2e_avg_s: float | None = None
    last_error: str | None = None
    last_poll_ts: float | None = None
    poll_age_s: float | None = None
    effective_weight: float | None = None
    """From the routing snapshot (weight x slow-start ramp)."""
    routed_max_concurrency: int | None = None
    """From the routing snapshot: ``max_concurrency`` lowered to a llama.cpp node's slots
    (:mod:`controlplane.routing.nodekind`); ``None`` before the first snapshot."""
    inflight: int = 0
    """Sum of in-flight requests over fresh edges."""
    requests: int = 0
    failures: int = 0
    error_rate: float | None = None
    """failures / requests over fresh edges (cumulative since the edges started)."""
    breaker: str | None = None
    breakers: dict[str, str] = field(default_factory=dict)
    edge_latency_ms: float | None = None
    edges: int = 0
    history: dict[str, list] | None = None
    """With ``history=True``: oldest first, ``{"ts": [...], "queue_depth": [...],
    "running": [...], "kv_cache_usage": [...], "e2e_avg_s": [...], "ttft_avg_s": [...],
    "score": [...]}`` over the last :data:`HISTORY_WINDOW_S` seconds."""

    def to_dict(self) -> dict:
        return asdict(self)


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _loads(raw: str | None) -> dict:
    if not raw:
        return {}
    try:
        d = json.loads(raw)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def edge_stats(raw_edges: dict[str, str], now: float, stale_s: float) -> dict[str, EdgeAgg]:
    """Sum the per-edge stats (hash ``infergate:v1:edges``) per node, skipping edges whose
    ``ts`` is older than ``stale_s`` seconds (``wire.edge_fresh_s(edge.stale_after_s)``)."""
    out: dict[str, EdgeAgg] = {}
    lat: dict[str, list[float]] = {}
    for rep in fresh_edge_reports(raw_edges, now, stale_s):
        for name, st in rep.nodes.items():
            a = out.setdefault(name, EdgeAgg())
            a.edges += 1
            a.inflight += st.inflight
            a.requests += st.requests
            a.failures += st.failures
            b = st.breaker
            if b is not None:
                a.breakers[rep.edge_id] = b
                if a.breaker is None or BREAKER_RANK[b] > BREAKER_RANK[a.breaker]:
                    a.breaker = b
            if st.latency_ewma_ms is not None:
                lat.setdefault(name, []).append(st.latency_ewma_ms)
    for name, vals in lat.items():
        out[name].latency_ewma_ms = round(sum(vals) / len(vals), 1)
    return out


def _history(raw_points: list[str], now: float, window_s: float) -> dict[str, list]:
    cols = ("ts", "queue_depth", "running", "kv_cache_usage", "e2e_avg_s", "ttft_avg_s", "score")
    out: dict[str, list] = {c: [] for c in cols}
    for raw in reversed(raw_points):  # stored newest first
        p = _loads(raw)
        ts = _num(p.get("ts"))
        if ts is None or now - ts > window_s:
            continue
        for c in cols:
            out[c].append(_num(p.get(c)))
    return out


def build_views(r: redis.Redis, settings: Settings, *, name: str | None = None,
                history: bool = False, history_window_s: float = HISTORY_WINDOW_S,
                now: float | None = None) -> list[NodeView]:
    """Views of every registered node (or only ``name``), sorted by name.

    Raises ``redis.exceptions.RedisError`` when Redis is unreachable."""
    now = time.time() if now is None else now
    nodes = registry.list_nodes(r)
    if name is not None:
        nodes = [n for n in nodes if n.name == name]
    states = registry.get_states(r)
    pipe = r.pipeline()
    pipe.hgetall(keynames.EDGES)
    pipe.get(keynames.ROUTING)
    for n in nodes:
        pipe.get(keynames.node_metrics(n.name))
        if history:
            pipe.lrange(keynames.node_history(n.name), 0, settings.controlplane.history_points - 1)
    res = pipe.execute()
    edges = edge_stats(res[0] or {}, now, edge_fresh_s(settings.edge.stale_after_s))
    snap = RoutingSnapshot.parse(res[1]) or RoutingSnapshot()
    eff = {sn.name: sn.effective_weight for sn in snap.nodes}
    routed = {sn.name: sn.max_concurrency for sn in snap.nodes}
    per = 2 if history else 1
    out = []
    for i, n in enumerate(nodes):
        m = NodeMetricsDoc.parse(res[2 + i * per]) or NodeMetricsDoc(name=n.name)
        st = states.get(n.name, registry.NodeState())
        healthy = m.healthy
        if st.state != "active":
            status = st.state
        elif healthy is None:
            status = "unknown"
        elif not healthy and REFUSED_TEXT in (m.last_error or ""):
            status = "credentials refused"  # the node answers 401/403: its API key
        elif m.stalled:
            status = "stalled"
        else:
            status = "active" if healthy else "down"
        e = edges.get(n.name, EdgeAgg())
        ts = _num(m.ts)
        v = NodeView(
            name=n.name, url=n.url, kind=n.kind, weight=n.weight,
            max_concurrency=n.max_concurrency, metrics_path=n.metrics_path,
            health_path=n.health_path, state=st.state, state_since=st.since or None,
            state_actor=st.actor, healthy=healthy, status=status,
            reachable=m.reachable, dialect=m.dialect, score=_num(m.score),
            saturated=m.saturated, queue_depth=_num(m.queue_depth), running=_num(m.running),
            kv_cache_usage=_num(m.kv_cache_usage), ttft_avg_s=_num(m.ttft_avg_s),
            e2e_avg_s=_num(m.e2e_avg_s), last_error=m.last_error, last_poll_ts=ts, poll_age_s=None if ts is None else round(max(0.0, now - ts), 3),
            effective_weight=_num(eff.get(n.name)),
            routed_max_concurrency=routed.get(n.name),
            inflight=e.inflight, requests=e.requests, failures=e.failures,
            error_rate=round(e.failures / e.requests, 4) if e.requests else None,
            breaker=e.breaker, breakers=e.breakers, edge_latency_ms=e.latency_ewma_ms,
            edges=e.edges,
        )
        if history:
            v.history = _history(res[3 + i * per] or [], now, history_window_s)
        out.append(v)
    return out


def build_view(r: redis.Redis, settings: Settings, name: str, *, history: bool = True,
               history_window_s: float = HISTORY_WINDOW_S) -> NodeView | None:
    """The view of one node (with history by default), ``None`` if not registered."""
    views = build_views(r, settings, name=name, history=history,
                        history_window_s=history_window_s)
    return views[0] if views else None
