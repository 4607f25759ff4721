"""The routing snapshot (``infergate:v1:routing``) and the decisions the leader takes
while writing it: slow start after undrain, and the draining -> drained transition.
Pure functions, plus a small caching host resolver.

Snapshot shape: docs/internals.md, "the routing snapshot", as the dataclasses
:class:`~controlplane.routing.wire.RoutingSnapshot` / ``SnapshotNode``. Per node:
``name, url, host, port, kind, state, healthy, weight, effective_weight,
max_concurrency, slots, slots_source, score, saturated, queue_depth, running, polled_at,
restarted_after, back_at, kv_cache_usage, has_metrics, models, models_any, scheme, tls_name, auth``
(``auth``: the ``Authorization`` value of a node with an API key, redacted wherever the
snapshot is served; ``models``: :mod:`controlplane.routing.models`, ``null`` = unknown;
``models_any``: the node takes a model no node lists too). Edge reports are read as :class:`~controlplane.routing.wire.EdgeReport`.

- ``host`` is an IP literal (the balancer phase of the edge cannot resolve names):
  hostnames are resolved here (IPv4 preferred), cached for ``HostResolver.ttl_s``;
  when a name cannot be resolved the last known address is kept, and with none
  ``host`` is ``null`` (the edge cannot route to that node).
- Slow start: for ``controlplane.slow_start_s`` after a node became ``active`` again
  (its state's ``since``), was added at run time or came back from unhealthy (the
  ``ramp_since`` the leader keeps, see ``routing/service.py``), ``effective_weight =
  weight x max(0.1, elapsed / slow_start_s)`` with ``elapsed`` counted from the latest
  of these; otherwise ``effective_weight = weight``.
- Slots (:func:`node_slots`): a node's known hard limit of requests at once, which the
  edge never exceeds (requests beyond wait at the edge): a llama.cpp server's
  ``total_slots`` (``slots_source = "server"``; ``max_concurrency`` is already lowered to
  it), else a ``max_concurrency`` set to another value than its default
  (``"config"``); otherwise ``null``.
- Drain: a ``draining`` node becomes ``drained`` when the sum of ``inflight`` over the
  fresh edge stats (``ts`` at most ``wire.EDGE_FRESH_FACTOR`` (3) x ``edge.stale_after_s``
  old) is 0 and the node's
  ``running`` is 0 or unknown -- but not before ``DRAIN_GRACE_SYNCS`` edge sync
  intervals have passed since the drain began, so every edge has seen the drain
  before its zero counts are believed -- or when ``controlplane.drain_timeout_s``
  passed, whatever the counts.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from controlplane.config import NodeSettings
from controlplane.routing.registry import NodeState
from controlplane.routing.wire import (
    EDGE_FRESH_FACTOR,
    EdgeReport,
    NodeMetricsDoc,
    RoutingSnapshot,
    SnapshotNode,
    fresh_edge_reports,
)

__all__ = ["DRAIN_GRACE_SYNCS", "EDGE_FORGET_S", "EDGE_FRESH_FACTOR", "DrainDecision",
           "HostResolver", "build_snapshot", "drain_decisions", "effective_weight",
           "fresh_inflight", "node_entry", "node_slots", "node_port", "stale_edges"]

#: Edge sync intervals to wait after a drain begins before in-flight counts of 0 count.
DRAIN_GRACE_SYNCS = 2


def effective_weight(weight: float, state: NodeState, now: float, slow_start_s: float,
                     ramp_since: float = 0.0) -> float:
    """Weight after the slow-start ramp (see module docstring). ``now``, ``ramp_since``
    (added at run time / healthy again; 0 = never) epoch s."""
    since = max(state.since, ramp_since)
    if state.state != "active" or since <= 0 or slow_start_s <= 0:
        return weight
    elapsed = max(now - since, 0.0)
    if elapsed >= slow_start_s:
        return weight
    return round(weight * max(0.1, elapsed / slow_start_s), 4)


#: An edge whose stats field has not changed for this long (s) is forgotten (HDEL).
EDGE_FORGET_S = 3600.0


def stale_edges(edges_raw: dict[str, str], now: float, max_age_s: float) -> list[str]:
    """Edge ids whose field in ``infergate:v1:edges`` is older than ``max_age_s`` seconds
    (or not valid JSON with a ``ts``): to be deleted."""
    out = []
    for edge_id, raw in edges_raw.items():
        rep = EdgeReport.from_field(edge_id, raw)
        if rep is None or not rep.is_fresh(now, max_age_s):
            out.append(edge_id)
    return out


def fresh_inflight(edges_raw: dict[str, str], now: float, max_age_s: float) -> dict[str, float]:
    """Sum of ``inflight`` per node (negative counts as 0) over the edge reports whose
    ``ts`` is at most ``max_age_s`` old (:func:`controlplane.routing.wire.edge_fresh_s`).
    Reports that are not JSON objects, and node entries that are not objects, are
    ignored."""
    out: dict[str, float] = {}
    for rep in fresh_edge_reports(edges_raw, now, max_age_s):
        for name, st in rep.nodes.items():
            out[name] = out.get(name, 0.0) + float(max(st.inflight, 0))
    return out


@dataclass(frozen=True)
class DrainDecision:
    name: str
    reason: str
    """``idle`` (no in-flight request anywhere) or ``timeout`` (drain_timeout_s passed)."""
    since: float
    """``since`` of the draining state the decision was taken on (for compare-and-set)."""


def drain_decisions(states: dict[str, NodeState], running: dict[str, float | None],
                    inflight: dict[str, float], now: float, *, drain_timeout_s: float,
                    grace_s: float) -> list[DrainDecision]:
    """Draining nodes that may now be set ``drained`` (rules in the module docstring).

    ``running``: the node's running requests from its metrics (``None`` = unknown)."""
    out = []
    for name, st in sorted(states.items()):
        if st.state != "draining":
            continue
        elapsed = now - st.since
        if elapsed >= drain_timeout_s:
            out.append(DrainDecision(name, "timeout", st.since))
        elif (elapsed >= grace_s and inflight.get(name, 0.0) <= 0
              and not (running.get(name) or 0.0) > 0):
            out.append(DrainDecision(name, "idle", st.since))
    return out


def node_port(url: str) -> int:
    """TCP port of a node URL (80 when the URL names none)."""
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def node_slots(node: NodeSettings, server_slots: int | None) -> tuple[int | None, str | None]:
    """``(slots, slots_source)`` of a node (module docstring): ``server_slots`` is the
    server's own count (llama.cpp ``total_slots``; ``None``: not reported)."""
    if server_slots is not None:
        return min(server_slots, node.max_concurrency), "server"
    default = NodeSettings.model_fields["max_concurrency"].default
    if node.max_concurrency != default:
        return node.max_concurrency, "config"
    return None, None


def node_entry(node: NodeSettings, state: NodeState, status: NodeMetricsDoc | None,
               host: str | None, now: float, slow_start_s: float,
               models: list[str] | None = None, ramp_since: float = 0.0,
               auth: str | None = None, server_slots: int | None = None,
               models_any: bool = False, ctx_tokens: int | None = None,
               restarted_after: float | None = None,
               back_at: float | None = None) -> SnapshotNode:
    """One ``nodes[]`` entry. ``status``: the node's latest metrics (``None`` before its
    first poll: healthy, no metrics); ``models``: served model ids (``None`` unknown);
    ``ramp_since``: epoch s the node was added at run time or became healthy again;
    ``auth``: the ``Authorization`` value the edge sends it (its API key; secret);
    ``server_slots``: the slots the server reports (``None``: not known);
    ``models_any``: the node takes any model besides ``models`` (only with a list);
    ``ctx_tokens``: the context of one of its slots (``None``: not known);
    ``restarted_after``: epoch s of the last reading of the process before its latest
    restart (``None``: none seen); ``back_at``: epoch s of the poll that saw it come
    back, healthy again or restarted (``None``: not seen)."""
    st = status or NodeMetricsDoc(name=node.name)
    scheme = urlsplit(node.url).scheme
    slots, slots_source = node_slots(node, server_slots)
    return SnapshotNode(
        name=node.name,
        url=node.url,
        host=host,
        port=node_port(node.url),
        kind=node.kind,
        state=state.state,
        healthy=True if st.healthy is None else st.healthy,
        connects=st.healthy is False and bool(st.busy or st.stalled
                                              or st.consecutive_successes > 0),
        weight=node.weight,
        effective_weight=effective_weight(node.weight, state, now, slow_start_s, ramp_since),
        max_concurrency=node.max_concurrency,
        slots=slots,
        slots_source=slots_source,
        ctx_tokens=ctx_tokens,
        score=st.score,
        saturated=bool(st.saturated),
        queue_depth=st.queue_depth,
        running=st.running,
        polled_at=st.ts,
        restarted_after=restarted_after,
        back_at=back_at,
        kv_cache_usage=st.kv_cache_usage,
        has_metrics=st.has_metrics,
        models=models,
        models_any=bool(models_any and models is not None),
        scheme=scheme,
        tls_name=urlsplit(node.url).hostname if scheme == "https" else None,
        auth=auth,
    )


def build_snapshot(*, version: int, now: float, leader: str, nodes: list[NodeSettings],
                   states: dict[str, NodeState], statuses: dict[str, NodeMetricsDoc],
                   hosts: dict[str, str | None], slow_start_s: float,
                   models: dict[str, list[str] | None] | None = None,
                   ramps: dict[str, float] | None = None,
                   auths: dict[str, str | None] | None = None,
                   slots: dict[str, int] | None = None,
                   models_any: set[str] | None = None,
                   contexts: dict[str, int] | None = None,
                   restarts: dict[str, float] | None = None,
                   backs: dict[str, float] | None = None) -> RoutingSnapshot:
    """The routing snapshot (docs/internals.md); ``.to_json()`` is what the leader
    writes. Nodes sorted by name. ``models``: served model ids per node (missing =
    unknown); ``ramps``: slow-start start (epoch s) per node added at run time or
    healthy again; ``auths``: the ``Authorization`` value per node with an API key;
    ``slots``: the slots each server reports (missing = not known); ``models_any``: the
    nodes that take any model besides their list (single-model llama.cpp servers);
    ``contexts``: the context of one slot per server that reports it (tokens);
    ``restarts``: per node restarted between two polls (its metrics' counters began
    again), the time of the last reading of the process before; ``backs``: per node,
    the time of the poll that saw it come back (healthy again, or restarted)."""
    models = models or {}
    contexts = contexts or {}
    ramps = ramps or {}
    auths = auths or {}
    slots = slots or {}
    return RoutingSnapshot(
        version=version,
        generated_at=round(now, 3),
        leader=leader,
        nodes=[node_entry(n, states.get(n.name, NodeState()), statuses.get(n.name),
                          hosts.get(n.name), now, slow_start_s, models.get(n.name),
                          ramps.get(n.name, 0.0), auth=auths.get(n.name),
                          server_slots=slots.get(n.name),
                          models_any=n.name in (models_any or ()),
                          ctx_tokens=contexts.get(n.name),
                          restarted_after=(restarts or {}).get(n.name),
                          back_at=(backs or {}).get(n.name))
               for n in sorted(nodes, key=lambda n: n.name)],
    )


def _getaddrinfo(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    v6 = [i[4][0] for i in infos if i[0] == socket.AF_INET6]
    return v4 + v6


class HostResolver:
    """Hostname -> IP literal with a cache (``ttl_s`` for answers, ``negative_ttl_s``
    for failures, during which the last good answer, if any, keeps being used)."""

    def __init__(self, ttl_s: float = 30.0, negative_ttl_s: float = 5.0,
                 lookup: Callable[[str], list[str]] = _getaddrinfo):
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._lookup = lookup
        self._cache: dict[str, tuple[str | None, float]] = {}

    def resolve(self, host: str, now: float) -> str | None:
        """IP literal for ``host`` (itself when already one); ``None`` if never resolved."""
        try:
            return str(ipaddress.ip_address(host.strip("[]")))
        except ValueError:
            pass
        cached = self._cache.get(host)
        if cached is not None and now < cached[1]:
            return cached[0]
        try:
            addrs = self._lookup(host)
        except OSError:
            addrs = []
        if addrs:
            self._cache[host] = (addrs[0], now + self.ttl_s)
            return addrs[0]
        last = cached[0] if cached else None
        self._cache[host] = (last, now + self.negative_ttl_s)
        return last

    def resolve_url(self, url: str, now: float) -> str | None:
        host = urlsplit(url).hostname
        return self.resolve(host, now) if host else None
