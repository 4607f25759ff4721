"""Reading inference-server metrics: Prometheus text of vLLM (V1 and pre-0.10), TGI and
SGLang, and a plain JSON dialect; see :mod:`.dialects` for every metric name read and
the version that introduced or renamed it, and :mod:`.window` for counter resets and
recent latency from histogram deltas.

Entry points: :func:`parse_metrics` (one body -> :class:`Reading`) and
:func:`window` (two readings -> :class:`Window`)."""

from __future__ import annotations

from controlplane.routing.nodemetrics.dialects import UnknownDialectError, detect, parse_json, parse_metrics
from controlplane.routing.nodemetrics.model import DIALECTS, Dialect, HistTotals, Reading, Window
from controlplane.routing.nodemetrics.prom import MetricsParseError, SampleTable, parse_prometheus
from controlplane.routing.nodemetrics.window import counter_delta, hist_delta, window

__all__ = [
    "DIALECTS", "Dialect", "HistTotals", "MetricsParseError", "Reading", "SampleTable",
    "UnknownDialectError", "Window", "counter_delta", "detect", "hist_delta",
    "parse_json", "parse_metrics", "parse_prometheus", "window",
]
