"""The routing snapshot (``infergate:v1:routing``) and the decisions the leader takes
while writing it: slow start after undrain, and the draining -> drained transition.
Pure functions, plus a small caching host resolver.

Snapshot shape: docs/internals.md, "the routing snapshot". Per node:
``name, url, host, port, kind, state, healthy, weight, effective_weight,
max_concurrency, score, saturated, queue_depth, running, kv_cache_usage,
has_metrics``.

- ``host`` is an IP literal (the balancer phase of the edge cannot resolve names):
  hostnames are resolved here (IPv4 preferred), cached for ``HostResolver.ttl_s``;
  when a name cannot be resolved the last known address is kept, and with none
  ``host`` is ``null`` (the edge cannot route to that node).
- Slow start: for ``controlplane.slow_start_s`` after a node became ``active`` again
  (its state's ``since``), ``effective_weight = weight x max(0.1, elapsed /
  slow_start_s)``; otherwise ``effective_weight = weight``.
- Drain: a ``draining`` node becomes ``drained`` when the sum of ``inflight`` over the
  fresh edge stats (``ts`` at most 3 x ``edge.stale_after_s`` old) is 0 and the node's
  ``running`` is 0 or unknown -- but not before ``DRAIN_GRACE_SYNCS`` edge sync
  intervals have passed since the drain began, so every edge has seen the drain
  before its zero counts are believed -- or when ``controlplane.drain_timeout_s``
  passed, whatever the counts.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from controlplane.config import NodeSettings
from controlplane.routing.registry import NodeState

#: Edge sync intervals to wait after a drain begins before in-flight counts of 0 count.
DRAIN_GRACE_SYNCS = 2
#: Edge stats older than this many ``edge.stale_after_s`` are ignored.
EDGE_FRESH_FACTOR = 3.0


def effective_weight(weight: float, state: NodeState, now: float, slow_start_s: float) -> float:
    """Weight after the slow-start ramp (see module docstring). ``now`` epoch s."""
    if state.state != "active" or state.since <= 0 or slow_start_s <= 0:
        return weight
    elapsed = max(now - state.since, 0.0)
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
        try:
            ts = float(json.loads(raw)["ts"])
        except (ValueError, TypeError, KeyError):
            out.append(edge_id)
            continue
        if now - ts > max_age_s:
            out.append(edge_id)
    return out


def fresh_inflight(edges_raw: dict[str, str], now: float, max_age_s: float) -> dict[str, float]:
    """Sum of ``inflight`` per node over the edge fields whose ``ts`` is at most
    ``max_age_s`` old. Fields that are not valid JSON of the documented shape are
    ignored."""
    out: dict[str, float] = {}
    for raw in edges_raw.values():
        try:
            doc = json.loads(raw)
            ts = float(doc["ts"])
            nodes = doc.get("nodes") or {}
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if now - ts > max_age_s or not isinstance(nodes, dict):
            continue
        for name, stats in nodes.items():
            try:
                n = float(stats.get("inflight", 0) or 0)
            except (TypeError, ValueError, AttributeError):
                continue
            out[name] = out.get(name, 0.0) + max(n, 0.0)
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


def node_entry(node: NodeSettings, state: NodeState, status: dict | None, host: str | None,
               now: float, slow_start_s: float) -> dict:
    """One ``nodes[]`` entry. ``status``: the node's metrics JSON (``None`` before its
    first poll: healthy, no metrics)."""
    st = status or {}
    return {
        "name": node.name,
        "url": node.url,
        "host": host,
        "port": node_port(node.url),
        "kind": node.kind,
        "state": state.state,
        "healthy": bool(st.get("healthy", True)),
        "weight": node.weight,
        "effective_weight": effective_weight(node.weight, state, now, slow_start_s),
        "max_concurrency": node.max_concurrency,
        "score": st.get("score"),
        "saturated": bool(st.get("saturated", False)),
        "queue_depth": st.get("queue_depth"),
        "running": st.get("running"),
        "kv_cache_usage": st.get("kv_cache_usage"),
        "has_metrics": bool(st.get("has_metrics", False)),
    }


def build_snapshot(*, version: int, now: float, leader: str, nodes: list[NodeSettings],
                   states: dict[str, NodeState], statuses: dict[str, dict],
                   hosts: dict[str, str | None], slow_start_s: float) -> dict:
    """The routing snapshot document (docs/internals.md). Nodes sorted by name."""
    return {
        "version": version,
        "generated_at": round(now, 3),
        "leader": leader,
        "nodes": [node_entry(n, states.get(n.name, NodeState()), statuses.get(n.name),
                             hosts.get(n.name), now, slow_start_s)
                  for n in sorted(nodes, key=lambda n: n.name)],
    }


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
