"""Prometheus text exposition -> a flat table of samples.

Parsing uses ``prometheus_client.parser.text_string_to_metric_families`` and then works
on *samples* (``name{labels} value``), not families, so a scrape without ``# TYPE``
lines (untyped) reads the same as a typed one. Non-finite values (``NaN``, ``+Inf``)
are dropped: a gauge that reports NaN is "unknown", never a number to add up.

A ``deadline`` (``time.monotonic()`` seconds) time-boxes a parse: the text is fed to the
parser line by line and the deadline checked every :data:`CHECK_EVERY` lines, so a huge
page is given up (:class:`MetricsParseError`) instead of holding a poll worker.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.parser import text_fd_to_metric_families

from controlplane.errors import InfergateError

#: Sorted ``(label, value)`` pairs identifying one series of a metric.
SeriesKey = tuple[tuple[str, str], ...]


class MetricsParseError(InfergateError, ValueError):
    """The body is not Prometheus text (nor JSON, for the JSON dialect)."""


@dataclass
class SampleTable:
    """``samples[name][series] = value`` for every finite sample in one scrape."""

    samples: dict[str, dict[SeriesKey, float]] = field(default_factory=dict)

    def names(self) -> set[str]:
        return set(self.samples)

    def series(self, name: str) -> dict[SeriesKey, float]:
        """All series of sample ``name`` (empty dict when absent)."""
        return self.samples.get(name, {})

    def total(self, name: str) -> float | None:
        """Sum over every series (engine ranks, models); ``None`` when absent."""
        s = self.samples.get(name)
        return math.fsum(s.values()) if s else None

    def maximum(self, name: str) -> float | None:
        """Largest value over every series; ``None`` when absent."""
        s = self.samples.get(name)
        return max(s.values()) if s else None

    def label_values(self, label: str) -> set[str]:
        """Every value the label ``label`` takes in any series."""
        out: set[str] = set()
        for series in self.samples.values():
            for key in series:
                for k, v in key:
                    if k == label:
                        out.add(v)
        return out


def series_key(labels: dict[str, str], drop: tuple[str, ...] = ()) -> SeriesKey:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in drop))


#: Lines parsed between two looks at the deadline (a few ms of parsing).
CHECK_EVERY = 256


class ParseTimeout(MetricsParseError):
    """The parse did not finish before its deadline."""


def _lines(text: str, deadline: float | None) -> Iterator[str]:
    for i, line in enumerate(io.StringIO(text)):
        if deadline is not None and i % CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise ParseTimeout(f"parse given up after {i} lines: over its time box")
        yield line


def parse_prometheus(text: str, rename: dict[str, str] | None = None,
                     deadline: float | None = None) -> SampleTable:
    """Parse Prometheus text format into a :class:`SampleTable`.

    ``rename`` maps a sample-name prefix to another (e.g. ``{"sglang_": "sglang:"}``),
    applied before storing. Histogram ``_bucket`` samples are skipped (only ``_sum``
    and ``_count`` are used). ``deadline``: ``time.monotonic()`` seconds after which the
    parse is given up (:class:`ParseTimeout`). Raises :class:`MetricsParseError` on
    malformed text."""
    table = SampleTable()
    try:
        for family in text_fd_to_metric_families(_lines(text, deadline)):  # type: ignore[arg-type]
            for s in family.samples:
                name = s.name
                if name.endswith("_bucket"):
                    continue
                if rename:
                    for old, new in rename.items():
                        if name.startswith(old):
                            name = new + name[len(old):]
                            break
                try:
                    value = float(s.value)
                except (TypeError, ValueError):
                    continue
                if not math.isfinite(value):
                    continue
                key = series_key(s.labels)
                bucket = table.samples.setdefault(name, {})
                # A repeated series (invalid, but seen) keeps its last value.
                bucket[key] = value
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from None
    return table
