"""``GET /metrics`` of the simulated node, in the dialect of the server it imitates.

Every exporter keeps its metrics in a private ``prometheus_client.CollectorRegistry``
(never the global one), so several nodes can live in one process and
:meth:`Exporter.reset` can drop everything (a restarted server's counters start at 0).

Latencies are in **wall-clock seconds** as observed by the simulator (so with
``--time-scale 0.1`` a simulated 1 s step shows as 0.1 s), which is what a poller
measuring the node from outside would see.

Dialects and their sources:

- ``vllm``: vLLM V1 names (``vllm/v1/metrics/loggers.py``), labels ``model_name`` and
  ``engine`` (one series per engine rank, ``engine="0".."N-1"``):
  gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (0-1; added in vLLM 0.9 as the new name of
  ``vllm:gpu_cache_usage_perc``, which is hidden from 0.10 on); counters
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total`` (extra label ``finished_reason``: ``stop`` |
  ``length``), ``vllm:prefix_cache_queries_total`` ("Prefix cache queries, in terms
  of number of queried tokens.") and ``vllm:prefix_cache_hits_total`` ("Prefix cache
  hits, in terms of number of cached tokens."), counted at admission (names added in
  vLLM 0.9.2; ``vllm:gpu_prefix_cache_queries`` / ``vllm:gpu_prefix_cache_hits`` are
  the deprecated spellings, hidden from 0.11 on); histograms ``vllm:time_to_first_token_seconds``,
  ``vllm:time_per_output_token_seconds``, ``vllm:inter_token_latency_seconds`` (same
  observations as TPOT, as recent vLLM emits both), ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_queue_time_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``. Buckets are vLLM's.
- ``vllm-legacy``: the same, before 0.9: ``vllm:gpu_cache_usage_perc`` instead of
  ``vllm:kv_cache_usage_perc``, ``vllm:gpu_prefix_cache_queries_total`` /
  ``vllm:gpu_prefix_cache_hits_total`` instead of ``vllm:prefix_cache_*`` and no
  ``vllm:inter_token_latency_seconds``.
- ``tgi``: Hugging Face TGI router names (TGI docs, "Metrics" reference), no labels,
  summed over engine ranks: gauges ``tgi_queue_size``, ``tgi_batch_current_size``;
  histograms ``tgi_request_duration`` (e2e), ``tgi_request_queue_duration``,
  ``tgi_request_mean_time_per_token_duration``, ``tgi_request_input_length``,
  ``tgi_request_generated_tokens``; counters ``tgi_request_count`` and
  ``tgi_request_success`` exported *untyped* so the sample names carry no ``_total``
  (TGI's Rust exporter writes them without it).
- ``sglang``: SGLang names (SGLang docs, "Production Metrics"), label ``model_name``,
  summed over ranks: gauges ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage`` (0-1), ``sglang:num_used_tokens``; counters
  ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``,
  ``sglang:num_requests_total``; histograms ``sglang:time_to_first_token_seconds``,
  ``sglang:inter_token_latency_seconds``, ``sglang:e2e_request_latency_seconds``;
  gauge ``sglang:cache_hit_rate`` (0-1; here hit tokens / queried tokens of the prefix
  cache since start or the last reset, all ranks).
- ``json``: ``{"queue_depth": int, "avg_latency_seconds": float,
  "gpu_memory_utilization": 0-1}``; latency = mean e2e of the last 50 finished
  requests (0.0 when none), utilization = KV tokens held / KV capacity, all ranks.
- ``none``: no metrics endpoint (404), like llama.cpp without ``--metrics`` or Ollama.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

Dialect = Literal["vllm", "vllm-legacy", "tgi", "sglang", "json", "none"]
DIALECTS: tuple[str, ...] = ("vllm", "vllm-legacy", "tgi", "sglang", "json", "none")
FinishReason = Literal["stop", "length"]

# Buckets from vLLM's v1 PrometheusStatLogger.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)
JSON_LATENCY_WINDOW = 50


@dataclass(frozen=True)
class EngineSnapshot:
    """Gauge values of one engine rank at scrape time."""

    running: int
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    prefix_queries_tokens: int = 0
    """Prompt tokens looked up in the prefix cache so far (counter)."""
    prefix_hits_tokens: int = 0
    """Of those, tokens found in the cache (counter)."""
    prefix_cached_blocks: int = 0
    """Blocks in the prefix cache now."""

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


def prefix_hit_rate(snaps: Sequence[EngineSnapshot]) -> float:
    """Hit tokens / queried tokens of the prefix caches of all ranks (0.0 before any
    query)."""
    queries = sum(s.prefix_queries_tokens for s in snaps)
    return sum(s.prefix_hits_tokens for s in snaps) / queries if queries else 0.0


@dataclass(frozen=True)
class Finished:
    """A request that finished normally; times in wall seconds."""

    rank: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    queue_s: float
    e2e_s: float


class Exporter:
    """Base: records request events, renders ``GET /metrics``.

    ``render`` returns ``(body, content_type)`` or None when the dialect has no
    metrics endpoint."""

    dialect: str = "none"

    def __init__(self, model: str, engines: int) -> None:
        if engines < 1:
            raise ValueError("engines must be >= 1")
        self.model = model
        self.engines = engines
        self.reset()

    def reset(self) -> None:
        """Forget every counter and histogram (as after a server restart)."""

    def first_token(self, rank: int, prompt_tokens: int, ttft_s: float) -> None:
        """The prefill of a request is done and its first token is out."""

    def token(self, rank: int, itl_s: float | None) -> None:
        """One generated token (``itl_s`` = time since the previous one, None for the first)."""

    def finished(self, f: Finished) -> None:
        """A request finished normally."""

    def render(self, snaps: Sequence[EngineSnapshot]) -> tuple[bytes, str] | None:
        return None


class _PromExporter(Exporter):
    registry: CollectorRegistry

    def reset(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._build()

    def _build(self) -> None:
        raise NotImplementedError

    def _set_gauges(self, snaps: Sequence[EngineSnapshot]) -> None:
        raise NotImplementedError

    def render(self, snaps: Sequence[EngineSnapshot]) -> tuple[bytes, str] | None:
        self._set_gauges(snaps)
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


class _VllmPrefixCounters(Collector):
    """The prefix-cache counters of every rank, read from the engines' totals at scrape
    time (``CounterMetricFamily`` writes the ``_total`` samples)."""

    def __init__(self, model: str, engines: int, legacy: bool) -> None:
        self.model = model
        self.engines = engines
        self.prefix = "vllm:gpu_prefix_cache" if legacy else "vllm:prefix_cache"
        self.doc_prefix = "GPU prefix cache" if legacy else "Prefix cache"
        self.snaps: Sequence[EngineSnapshot] = ()

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "engine"]
        queries = CounterMetricFamily(
            f"{self.prefix}_queries",
            f"{self.doc_prefix} queries, in terms of number of queried tokens.", labels=labels)
        hits = CounterMetricFamily(
            f"{self.prefix}_hits",
            f"{self.doc_prefix} hits, in terms of number of cached tokens.", labels=labels)
        for rank in range(self.engines):
            s = self.snaps[rank] if rank < len(self.snaps) else None
            lv = [self.model, str(rank)]
            queries.add_metric(lv, s.prefix_queries_tokens if s else 0)
            hits.add_metric(lv, s.prefix_hits_tokens if s else 0)
        yield queries
        yield hits


class VllmExporter(_PromExporter):
    """vLLM V1 (``legacy=False``) or pre-0.9 names (``legacy=True``)."""

    def __init__(self, model: str, engines: int, legacy: bool = False) -> None:
        self.legacy = legacy
        self.dialect = "vllm-legacy" if legacy else "vllm"
        super().__init__(model, engines)

    def _build(self) -> None:
        r, labels = self.registry, ["model_name", "engine"]
        self.g_running = Gauge("vllm:num_requests_running",
                               "Number of requests in model execution batches.", labels, registry=r)
        self.g_waiting = Gauge("vllm:num_requests_waiting",
                               "Number of requests waiting to be processed.", labels, registry=r)
        if self.legacy:
            self.g_kv = Gauge("vllm:gpu_cache_usage_perc",
                              "GPU KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        else:
            self.g_kv = Gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        self.c_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                labels, registry=r)
        self.c_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                             labels, registry=r)
        self.c_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                 labels + ["finished_reason"], registry=r)
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", labels,
                                buckets=TTFT_BUCKETS, registry=r)
        self.h_tpot = Histogram("vllm:time_per_output_token_seconds",
                                "Histogram of time per output token in seconds.", labels,
                                buckets=TPOT_BUCKETS, registry=r)
        self.h_itl = None if self.legacy else Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            labels, buckets=TPOT_BUCKETS, registry=r)
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds",
                               "Histogram of e2e request latency in seconds.", labels,
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.h_queue = Histogram("vllm:request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.", labels,
                                 buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.h_req_prompt = Histogram("vllm:request_prompt_tokens",
                                      "Number of prefill tokens processed.", labels,
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.h_req_gen = Histogram("vllm:request_generation_tokens",
                                   "Number of generation tokens processed.", labels,
                                   buckets=TOKEN_BUCKETS, registry=r)
        self.prefix_counters = _VllmPrefixCounters(self.model, self.engines, self.legacy)
        r.register(self.prefix_counters)
        # Series exist from the start for every rank, as vLLM creates them per engine.
        for rank in range(self.engines):
            lv = self._lv(rank)
            for m in (self.g_running, self.g_waiting, self.g_kv, self.c_prompt, self.c_gen,
                      self.h_ttft, self.h_tpot, self.h_e2e, self.h_queue, self.h_req_prompt,
                      self.h_req_gen):
                m.labels(*lv)
            if self.h_itl is not None:
                self.h_itl.labels(*lv)
            for reason in ("stop", "length"):
                self.c_success.labels(*lv, reason)

    def _lv(self, rank: int) -> tuple[str, str]:
        return (self.model, str(rank))

    def first_token(self, rank: int, prompt_tokens: int, ttft_s: float) -> None:
        self.c_prompt.labels(*self._lv(rank)).inc(prompt_tokens)
        self.h_ttft.labels(*self._lv(rank)).observe(ttft_s)

    def token(self, rank: int, itl_s: float | None) -> None:
        lv = self._lv(rank)
        self.c_gen.labels(*lv).inc()
        if itl_s is not None:
            self.h_tpot.labels(*lv).observe(itl_s)
            if self.h_itl is not None:
                self.h_itl.labels(*lv).observe(itl_s)

    def finished(self, f: Finished) -> None:
        lv = self._lv(f.rank)
        self.c_success.labels(*lv, f.finish_reason).inc()
        self.h_e2e.labels(*lv).observe(f.e2e_s)
        self.h_queue.labels(*lv).observe(f.queue_s)
        self.h_req_prompt.labels(*lv).observe(f.prompt_tokens)
        self.h_req_gen.labels(*lv).observe(f.completion_tokens)

    def _set_gauges(self, snaps: Sequence[EngineSnapshot]) -> None:
        for rank, s in enumerate(snaps):
            lv = self._lv(rank)
            self.g_running.labels(*lv).set(s.running)
            self.g_waiting.labels(*lv).set(s.waiting)
            self.g_kv.labels(*lv).set(s.kv_usage)
        self.prefix_counters.snaps = list(snaps)


class _TgiCounters(Collector):
    """TGI's counters, written without the ``_total`` suffix."""

    def __init__(self) -> None:
        self.count = 0
        self.success = 0

    def collect(self) -> Iterable[Metric]:
        yield UnknownMetricFamily("tgi_request_count", "Total number of requests", value=self.count)
        yield UnknownMetricFamily("tgi_request_success", "Number of successful requests",
                                  value=self.success)


class TgiExporter(_PromExporter):
    dialect = "tgi"

    def _build(self) -> None:
        r = self.registry
        self.g_queue = Gauge("tgi_queue_size", "Current queue size", registry=r)
        self.g_batch = Gauge("tgi_batch_current_size", "Current batch size", registry=r)
        self.h_duration = Histogram("tgi_request_duration",
                                    "Total time spent processing the request (e2e latency)",
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.h_queue = Histogram("tgi_request_queue_duration", "Time spent in the queue per request",
                                 buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.h_tpt = Histogram("tgi_request_mean_time_per_token_duration",
                               "Mean time per token per request", buckets=TPOT_BUCKETS, registry=r)
        self.h_input = Histogram("tgi_request_input_length", "Input token length per request",
                                 buckets=TOKEN_BUCKETS, registry=r)
        self.h_gen = Histogram("tgi_request_generated_tokens", "Generated tokens per request",
                               buckets=TOKEN_BUCKETS, registry=r)
        self.counters = _TgiCounters()
        r.register(self.counters)

    def first_token(self, rank: int, prompt_tokens: int, ttft_s: float) -> None:
        self.counters.count += 1

    def finished(self, f: Finished) -> None:
        self.counters.success += 1
        self.h_duration.observe(f.e2e_s)
        self.h_queue.observe(f.queue_s)
        self.h_input.observe(f.prompt_tokens)
        self.h_gen.observe(f.completion_tokens)
        if f.completion_tokens > 1:
            self.h_tpt.observe(max(0.0, f.e2e_s - f.queue_s) / f.completion_tokens)

    def _set_gauges(self, snaps: Sequence[EngineSnapshot]) -> None:
        self.g_queue.set(sum(s.waiting for s in snaps))
        self.g_batch.set(sum(s.running for s in snaps))


class SglangExporter(_PromExporter):
    dialect = "sglang"

    def _build(self) -> None:
        r, labels = self.registry, ["model_name"]
        self.g_running = Gauge("sglang:num_running_reqs", "The number of running requests.",
                               labels, registry=r)
        self.g_queue = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                             labels, registry=r)
        self.g_usage = Gauge("sglang:token_usage", "The token usage.", labels, registry=r)
        self.g_used = Gauge("sglang:num_used_tokens", "The number of used tokens.", labels,
                            registry=r)
        self.c_prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                                labels, registry=r)
        self.c_gen = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                             labels, registry=r)
        self.c_requests = Counter("sglang:num_requests", "The number of processed requests.",
                                  labels, registry=r)
        self.h_ttft = Histogram("sglang:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", labels,
                                buckets=TTFT_BUCKETS, registry=r)
        self.h_itl = Histogram("sglang:inter_token_latency_seconds",
                               "Histogram of inter-token latency in seconds.", labels,
                               buckets=TPOT_BUCKETS, registry=r)
        self.h_e2e = Histogram("sglang:e2e_request_latency_seconds",
                               "Histogram of End-to-end request latency in seconds", labels,
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.g_hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", labels,
                                registry=r)
        for m in (self.g_running, self.g_queue, self.g_usage, self.g_used, self.c_prompt,
                  self.c_gen, self.c_requests, self.h_ttft, self.h_itl, self.h_e2e,
                  self.g_hit_rate):
            m.labels(self.model)

    def first_token(self, rank: int, prompt_tokens: int, ttft_s: float) -> None:
        self.c_prompt.labels(self.model).inc(prompt_tokens)
        self.h_ttft.labels(self.model).observe(ttft_s)

    def token(self, rank: int, itl_s: float | None) -> None:
        self.c_gen.labels(self.model).inc()
        if itl_s is not None:
            self.h_itl.labels(self.model).observe(itl_s)

    def finished(self, f: Finished) -> None:
        self.c_requests.labels(self.model).inc()
        self.h_e2e.labels(self.model).observe(f.e2e_s)

    def _set_gauges(self, snaps: Sequence[EngineSnapshot]) -> None:
        used = sum(s.kv_used_tokens for s in snaps)
        cap = sum(s.kv_capacity_tokens for s in snaps)
        self.g_running.labels(self.model).set(sum(s.running for s in snaps))
        self.g_queue.labels(self.model).set(sum(s.waiting for s in snaps))
        self.g_used.labels(self.model).set(used)
        self.g_usage.labels(self.model).set(used / cap if cap else 0.0)
        self.g_hit_rate.labels(self.model).set(prefix_hit_rate(snaps))


class JsonExporter(Exporter):
    dialect = "json"

    def reset(self) -> None:
        self.latencies: deque[float] = deque(maxlen=JSON_LATENCY_WINDOW)

    def finished(self, f: Finished) -> None:
        self.latencies.append(f.e2e_s)

    def render(self, snaps: Sequence[EngineSnapshot]) -> tuple[bytes, str] | None:
        used = sum(s.kv_used_tokens for s in snaps)
        cap = sum(s.kv_capacity_tokens for s in snaps)
        avg = sum(self.latencies) / len(self.latencies) if self.latencies else 0.0
        body = {"queue_depth": sum(s.waiting for s in snaps), "avg_latency_seconds": avg,
                "gpu_memory_utilization": used / cap if cap else 0.0}
        return json.dumps(body).encode(), "application/json"


def make_exporter(dialect: str, model: str, engines: int) -> Exporter:
    """The exporter of ``dialect`` (one of :data:`DIALECTS`); ValueError otherwise."""
    if dialect == "vllm":
        return VllmExporter(model, engines)
    if dialect == "vllm-legacy":
        return VllmExporter(model, engines, legacy=True)
    if dialect == "tgi":
        return TgiExporter(model, engines)
    if dialect == "sglang":
        return SglangExporter(model, engines)
    if dialect == "json":
        return JsonExporter(model, engines)
    if dialect == "none":
        return Exporter(model, engines)
    raise ValueError(f"unknown dialect {dialect!r}; one of {', '.join(DIALECTS)}")
