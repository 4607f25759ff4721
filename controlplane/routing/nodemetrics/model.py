"""Wire-independent shapes of one metrics scrape (:class:`Reading`) and of what two
consecutive scrapes say about the recent past (:class:`Window`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from controlplane.routing.nodemetrics.prom import SeriesKey

Dialect = Literal["vllm", "vllm-legacy", "tgi", "sglang", "llamacpp", "json"]
DIALECTS: tuple[str, ...] = ("vllm", "vllm-legacy", "tgi", "sglang", "llamacpp", "json")


@dataclass(frozen=True)
class HistTotals:
    """Cumulative ``_sum`` (seconds) and ``_count`` (observations) of one histogram series."""

    sum: float
    count: float


@dataclass
class Reading:
    """Instant values of one scrape, already aggregated over engine ranks and models.

    - ``queue_depth``, ``running``: requests, summed over every series (data-parallel
      engine ranks, several ``model_name`` values). ``None`` = not exported.
    - ``kv_cache_usage``: 0-1, the largest over every series (the fullest engine is the
      one that preempts first). ``None`` = not exported (TGI has no such gauge).
    - ``e2e`` / ``ttft``: cumulative histogram totals per series, kept per series so a
      restart of one engine rank is detected on its own (see :mod:`.window`).
      ``None`` = the dialect has no such histogram.
    - ``prompt_tokens`` / ``generation_tokens``: cumulative counters per series.
    - ``e2e_avg_s_direct``: an average the server computed itself (JSON dialect only).
    """

    dialect: Dialect
    queue_depth: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    e2e: dict[SeriesKey, HistTotals] | None = None
    ttft: dict[SeriesKey, HistTotals] | None = None
    prompt_tokens: dict[SeriesKey, float] | None = None
    generation_tokens: dict[SeriesKey, float] | None = None
    progress: dict[SeriesKey, float] | None = None
    """The dialect's progress counter per series (``PromDialect.progress``), or None."""
    e2e_avg_s_direct: float | None = None
    engines: int = 1
    models: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class Window:
    """What happened between two scrapes of the same node.

    ``e2e_avg_s`` / ``ttft_avg_s``: mean latency in seconds of the requests that
    finished in between (sum delta / count delta); ``None`` when none finished or
    there is no earlier scrape -- never 0 for "no data". ``finished``: requests
    finished in between (``None`` without an earlier scrape or histogram).
    ``*_tokens_delta``: tokens processed in between. ``*_tokens_total``: the current
    cumulative totals (summed over series)."""

    e2e_avg_s: float | None = None
    ttft_avg_s: float | None = None
    finished: float | None = None
    prompt_tokens_delta: float | None = None
    generation_tokens_delta: float | None = None
    progress_delta: float | None = None
    """How far the dialect's progress counter advanced in between (llama.cpp's decode
    calls), or None."""
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    restarted: bool = False
    """A counter or histogram series of both scrapes went down: the server (or one of
    its engine ranks) restarted in between and began counting again from zero."""
