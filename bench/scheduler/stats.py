"""From per-request results and node samples to the published records (pure logic).

Definitions (all times in wall-clock seconds as measured; divide by the run's
``time_scale`` for simulated seconds):

- ``ok``: HTTP 200 and ``data: [DONE]`` before the deadline. ``timeout``: the deadline
  came first (the client gave up). ``error``: anything else (an error status such as
  429/502/503, a connection error, a stream cut short). ``rejected``: errors with status
  429 (shed by the edge), also counted in ``errors``.
- ``p50_s``, ``p99_s``: percentiles of end-to-end latency over ok and timed-out
  requests, a timed-out request counting as the deadline (a lower bound of what it
  would have taken): errors are left out, they are in ``error_rate``. ``p99_ok_s``:
  the same over ok requests only.
- ``ttft_p50_s``, ``ttft_p90_s``, ``ttft_p99_s``: time to first generated text over the
  same requests;
  a timed-out request without any text counts as the deadline.
- ``timeout_rate``, ``error_rate``: fractions (0-1) of all requests sent.
- ``goodput_rps``: ok requests per wall second of the arrival window; ``sent_rps``: all
  requests sent per wall second of that window (the Poisson draw of the offered rate).
- Utilisation of a node: mean over the samples of ``running / max_running`` (0-1, the
  fraction of its batch slots in use); ``busy``: fraction of samples with ``running >
  0``. ``imbalance`` = max - min utilisation over the nodes that had no injected fault.
- ``share``: each node's fraction of the inference requests the nodes received
  (retries included).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from ..common import mean, percentile, rounded
from .loadgen import Result, StateSamples


def latency_samples(results: Iterable[Result], deadline_s: float) -> tuple[list[float], list[float]]:
    """(e2e samples, ttft samples) of ok and timed-out requests; a timeout counts as
    ``deadline_s`` (and so does its TTFT when no text arrived)."""
    e2e: list[float] = []
    ttft: list[float] = []
    for r in results:
        if r.outcome == "ok":
            e2e.append(r.e2e_s if r.e2e_s is not None else deadline_s)
            ttft.append(r.ttft_s if r.ttft_s is not None else (r.e2e_s or deadline_s))
        elif r.outcome == "timeout":
            e2e.append(deadline_s)
            ttft.append(r.ttft_s if r.ttft_s is not None else deadline_s)
    return e2e, ttft


def utilisation(running: dict[str, Sequence[int]], max_running: int) -> dict[str, float]:
    """node -> mean of running / max_running over its samples (0-1)."""
    if max_running < 1:
        raise ValueError("max_running must be >= 1")
    return {name: min(1.0, (mean(xs) or 0.0) / max_running) for name, xs in running.items() if xs}


def busy_fraction(running: dict[str, Sequence[int]]) -> dict[str, float]:
    """node -> fraction of samples with at least one running request (0-1)."""
    return {name: sum(1 for x in xs if x > 0) / len(xs) for name, xs in running.items() if xs}


def imbalance(util: dict[str, float], exclude: Iterable[str] = ()) -> float | None:
    """max - min of ``util`` over the nodes not in ``exclude``; ``None`` with < 2 nodes."""
    skip = set(exclude)
    vals = [v for k, v in util.items() if k not in skip]
    if len(vals) < 2:
        return None
    return max(vals) - min(vals)


def shares(requests_total: dict[str, tuple[int, int]]) -> dict[str, float]:
    """node -> fraction of the requests received during the run (0-1)."""
    deltas = {k: max(0, b - a) for k, (a, b) in requests_total.items()}
    total = sum(deltas.values())
    return {k: (v / total if total else 0.0) for k, v in deltas.items()}


def summarise(results: Sequence[Result], *, deadline_s: float, duration_s: float,
              states: StateSamples | None = None, max_running: int = 1,
              faulty: Iterable[str] = ()) -> dict:
    """The statistics of one run (definitions in the module docstring). Raises
    ``ValueError`` for a non-positive deadline or duration."""
    if deadline_s <= 0 or duration_s <= 0:
        raise ValueError("deadline and duration must be > 0")
    n = len(results)
    outcomes = Counter(r.outcome for r in results)
    statuses = Counter(str(r.status) if r.status is not None else "none" for r in results)
    e2e, ttft = latency_samples(results, deadline_s)
    ok_e2e = [r.e2e_s for r in results if r.outcome == "ok" and r.e2e_s is not None]
    lags = [r.lag_s for r in results]
    rec = {
        "requests": n,
        "ok": outcomes["ok"],
        "timeouts": outcomes["timeout"],
        "errors": outcomes["error"],
        "rejected": sum(1 for r in results if r.outcome == "error" and r.status == 429),
        "p50_s": rounded(percentile(e2e, 50)),
        "p99_s": rounded(percentile(e2e, 99)),
        "p99_ok_s": rounded(percentile(ok_e2e, 99)),
        "ttft_p50_s": rounded(percentile(ttft, 50)),
        "ttft_p90_s": rounded(percentile(ttft, 90)),
        "ttft_p99_s": rounded(percentile(ttft, 99)),
        "timeout_rate": rounded(outcomes["timeout"] / n if n else 0.0),
        "error_rate": rounded(outcomes["error"] / n if n else 0.0),
        "goodput_rps": rounded(outcomes["ok"] / duration_s),
        "sent_rps": rounded(n / duration_s),
        "send_lag_p99_s": rounded(percentile(lags, 99)),
        "statuses": dict(sorted(statuses.items())),
    }
    if states is not None:
        util = utilisation(states.running, max_running)
        rec["utilisation"] = {k: rounded(v, 3) for k, v in sorted(util.items())}
        rec["busy"] = {k: rounded(v, 3) for k, v in sorted(busy_fraction(states.running).items())}
        rec["imbalance"] = rounded(imbalance(util, faulty), 3)
        rec["share"] = {k: rounded(v, 3) for k, v in sorted(shares(states.requests_total).items())}
        rec["state_samples"] = min((len(v) for v in states.running.values()), default=0)
    else:
        rec["imbalance"] = None
    errs = Counter((r.error or "")[:80] for r in results if r.outcome == "error")
    rec["top_errors"] = [{"error": e, "count": c} for e, c in errs.most_common(3)]
    return rec
