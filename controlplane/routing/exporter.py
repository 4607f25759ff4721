"""Prometheus metrics of one control plane, served at ``GET /metrics`` on
``controlplane.listen`` (text exposition format 0.0.4, ``prometheus_client``).

Each :class:`ControlPlaneMetrics` has its own registry (several control planes can live
in one process, e.g. in tests). Names follow the Prometheus conventions (base units,
``_total`` for counters, ``_seconds`` for durations):

==========================================================  =========  ==================================
name                                                        type       meaning
==========================================================  =========  ==================================
``infergate_controlplane_poll_duration_seconds``            histogram  one poll cycle (registry read, node
                                                                       polls, leader lock, writes), s
``infergate_controlplane_cycles_total``                     counter    poll cycles run
``infergate_controlplane_leader``                           gauge      1 while this instance holds the lock
``infergate_controlplane_snapshot_writes_total``            counter    routing snapshots written (leader)
``infergate_controlplane_snapshot_version``                 gauge      version of the last snapshot written
``infergate_controlplane_redis_up``                         gauge      1 if the last cycle reached Redis
``infergate_controlplane_redis_errors_total``               counter    Redis failures (one per failed step)
``infergate_controlplane_state_lost_total``                 counter    times Redis came back without its
                                                                       state (state marker missing)
``infergate_controlplane_state_lost_timestamp_seconds``     gauge      when it last did (epoch s; absent
                                                                       until it happens)
``infergate_controlplane_state_restored_total``             counter    times this control plane wrote its
                                                                       copy of the state back after a loss
``infergate_controlplane_apikeys_missing``                  gauge      1 while Redis holds no API keys after
                                                                       losing its state (edges keep known keys)
``infergate_controlplane_node_healthy{node}``               gauge      1 healthy, 0 unhealthy (hysteresis)
``infergate_controlplane_node_score{node}``                 gauge      health score, lower is better
``infergate_controlplane_node_queue_depth{node}``           gauge      requests waiting on the node
``infergate_controlplane_node_running{node}``               gauge      requests running on the node
``infergate_controlplane_node_kv_cache_usage_ratio{node}``  gauge      KV-cache use, 0-1
==========================================================  =========  ==================================

Node gauges come from the last cycle and are left out while a value is unknown (no
metrics endpoint, never polled); a removed node disappears with its series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from controlplane.routing.service import ControlPlane, CycleReport

#: Buckets of the poll-cycle histogram, seconds (a cycle is bounded by poll_timeout_s).
POLL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_NODE_GAUGES = (
    ("node_score", "score", "Health score of the node (lower is better, divided by weight)"),
    ("node_queue_depth", "queue_depth", "Requests waiting on the node (num_requests_waiting)"),
    ("node_running", "running", "Requests running on the node"),
    ("node_kv_cache_usage_ratio", "kv_cache_usage", "KV-cache usage of the node, 0-1"),
)


class _StateCollector(Collector):
    """Gauges and counters read from the control plane at scrape time."""

    def __init__(self, cp: "ControlPlane") -> None:
        self.cp = cp

    def collect(self) -> Iterator[Any]:
        cp = self.cp
        p = "infergate_controlplane_"
        leader = GaugeMetricFamily(p + "leader", "1 while this control plane holds the leader lock")
        leader.add_metric([], 1.0 if cp.elector.is_leader else 0.0)
        yield leader
        up = GaugeMetricFamily(p + "redis_up", "1 if the last poll cycle reached Redis")
        up.add_metric([], 1.0 if cp.redis_ok else 0.0)
        yield up
        errors = CounterMetricFamily(p + "redis_errors", "Redis failures seen by the poll loop")
        errors.add_metric([], float(getattr(cp, "redis_errors", 0)))
        yield errors
        lost = CounterMetricFamily(p + "state_lost", "Times Redis came back without its state "
                                   "(API keys, nodes, drain states lost)")
        lost.add_metric([], float(getattr(cp, "state_losses", 0)))
        yield lost
        lost_at = GaugeMetricFamily(p + "state_lost_timestamp_seconds",
                                    "When this control plane last found Redis' state lost")
        if getattr(cp, "state_lost_at", None) is not None:
            lost_at.add_metric([], float(cp.state_lost_at))
        yield lost_at
        restored = CounterMetricFamily(p + "state_restored", "Times this control plane "
                                       "wrote its copy of the state (API keys, nodes, drain "
                                       "states) back into Redis after a loss")
        restored.add_metric([], float(getattr(cp, "state_restores", 0)))
        yield restored
        keys_missing = GaugeMetricFamily(p + "apikeys_missing", "1 while Redis holds no API "
                                         "keys after losing its state (edges keep the keys "
                                         "they knew until `infergate keys import`)")
        keys_missing.add_metric([], 1.0 if getattr(cp, "apikeys_missing", False) else 0.0)
        yield keys_missing
        version = GaugeMetricFamily(p + "snapshot_version",
                                    "Version of the last routing snapshot this instance wrote")
        if cp.last_snapshot is not None:
            version.add_metric([], float(cp.last_snapshot.version))
        yield version
        report = cp.last_report
        statuses = report.statuses if report is not None else {}
        healthy = GaugeMetricFamily(p + "node_healthy", "1 if the node is healthy (after "
                                    "hysteresis), else 0", labels=["node"])
        for name, st in sorted(statuses.items()):
            healthy.add_metric([name], 1.0 if st.healthy else 0.0)
        yield healthy
        for metric, attr, doc in _NODE_GAUGES:
            g = GaugeMetricFamily(p + metric, doc, labels=["node"])
            for name, st in sorted(statuses.items()):
                value = getattr(st, attr, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    g.add_metric([name], float(value))
            yield g


class ControlPlaneMetrics:
    """The metrics of one :class:`controlplane.routing.service.ControlPlane`.

    ``observe(report)`` is called after every cycle (the control plane's
    ``cycle_listeners``); :meth:`wsgi_app` serves the text format."""

    def __init__(self, cp: "ControlPlane") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        p = "infergate_controlplane_"
        self.poll_duration = Histogram(p + "poll_duration_seconds",
                                       "Duration of one poll cycle, seconds",
                                       buckets=POLL_BUCKETS, registry=self.registry)
        self.cycles = Counter(p + "cycles", "Poll cycles run", registry=self.registry)
        self.snapshot_writes = Counter(p + "snapshot_writes",
                                       "Routing snapshots written by this instance (as leader)",
                                       registry=self.registry)
        self.registry.register(_StateCollector(cp))
        cp.cycle_listeners.append(self.observe)

    def observe(self, report: "CycleReport") -> None:
        """Count one finished cycle (duration in ms in the report)."""
        self.cycles.inc()
        self.poll_duration.observe(max(report.duration_ms, 0.0) / 1000.0)
        if report.wrote:
            self.snapshot_writes.inc()

    def wsgi_app(self) -> Any:
        """A WSGI app answering every path with the text exposition of this registry."""
        return make_wsgi_app(self.registry)
