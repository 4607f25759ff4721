"""Records, means over repeats, noise and tables of ``python -m bench.realnode compare``
(pure logic).

One **run** is one strategy on one schedule, once. Its record has the fields of
:func:`bench.scheduler.stats.summarise` (requests, ok, timeouts, errors, rejected = 429s,
``p50_s``/``p99_s`` over ok and timed-out requests with a timeout counting as the
deadline, ``ttft_p50_s``/``ttft_p90_s``, ``goodput_rps`` = ok requests per second of the
arrival window, ...) plus:

- ``cut``: streams cut short (:func:`bench.realnode.compare_load.is_cut`), also counted
  in ``errors``; ``cut_rate`` and ``rejected_rate``: fractions (0-1) of the requests sent.
- ``nodes``: per node, ``tokens`` generated during the run (from llama-server's
  ``tokens_predicted_total``), ``token_share`` (0-1 of the pool's tokens),
  ``utilisation`` (mean ``requests_processing`` / slots, 0-1) and ``deferred_mean`` /
  ``deferred_max`` (requests waiting inside llama-server for a slot).

Rows of the table are means over the repeats of one (scenario, load, strategy).
**Noise**: for each such group, the minimum and maximum over its repeats of goodput,
p50, p99 and TTFT p90, and the spread (max - min) in % of the mean. A strategy's
difference from the baseline is **beyond noise** when the two ranges (min-max over
repeats) do not overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from bench.common import format_table, mean, rounded
from bench.realnode.compare_load import NodeSamples
from bench.scheduler.loadgen import Result
from bench.scheduler.stats import summarise

BASELINE = "least_conn"
MEAN_FIELDS = ("offered_rps", "sent_rps", "goodput_rps", "p50_s", "p99_s", "ttft_p50_s",
               "ttft_p90_s", "timeout_rate", "rejected_rate", "cut_rate", "error_rate")
NOISE_FIELDS = ("goodput_rps", "p50_s", "p99_s", "ttft_p90_s")


def node_split(samples: NodeSamples, slots: dict[str, int]) -> dict[str, dict]:
    """Per node of ``slots`` (name -> slot count, in pool order): tokens, token_share,
    utilisation, deferred_mean, deferred_max (module docstring); ``None`` where no
    sample came."""
    deltas = {n: max(0.0, b - a) for n, (a, b) in samples.tokens.items()}
    total = sum(deltas.values())
    out: dict[str, dict] = {}
    for name, n_slots in slots.items():
        proc = samples.processing.get(name) or []
        dfr = samples.deferred.get(name) or []
        util = mean(proc)
        out[name] = {
            "tokens": int(deltas.get(name, 0.0)),
            "token_share": rounded(deltas.get(name, 0.0) / total, 3) if total else None,
            "utilisation": rounded(min(1.0, util / max(1, n_slots)), 3) if util is not None else None,
            "deferred_mean": rounded(mean(dfr), 3),
            "deferred_max": max(dfr) if dfr else None,
        }
    return out


def run_record(results: Sequence[Result], *, head: dict, deadline_s: float, window_s: float,
               samples: NodeSamples, slots: dict[str, int]) -> dict:
    """The record of one run: ``head`` (scenario, strategy, load_fraction, repeat, ...)
    then the statistics. Raises ``ValueError`` for a non-positive deadline or window."""
    rec = dict(head)
    rec.update(summarise(results, deadline_s=deadline_s, duration_s=window_s))
    n = rec["requests"]
    cut = sum(1 for r in results if getattr(r, "cut", False))
    rec["cut"] = cut
    rec["cut_rate"] = rounded(cut / n if n else 0.0)
    rec["rejected_rate"] = rounded(rec["rejected"] / n if n else 0.0)
    rec["nodes"] = node_split(samples, slots)
    rec["node_polls_failed"] = samples.failed_polls
    return rec


def groups(runs: Sequence[dict]) -> dict[tuple, list[dict]]:
    """(scenario, load_fraction, strategy) -> its runs, in the order first seen."""
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault((r["scenario"], r["load_fraction"], r["strategy"]), []).append(r)
    return out


def _mean_of(runs: Sequence[dict], key: str) -> float | None:
    return rounded(mean(r[key] for r in runs if r.get(key) is not None))


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """One row per (scenario, load, strategy): ``runs``, the mean of each of
    :data:`MEAN_FIELDS` over its repeats, ``cut`` and ``rejected`` summed, and per node
    the mean ``token_share`` and ``deferred_mean``."""
    rows = []
    for (scenario, load, strategy), rs in groups(runs).items():
        row: dict = {"scenario": scenario, "load_fraction": load, "strategy": strategy,
                     "runs": len(rs)}
        for key in MEAN_FIELDS:
            row[key] = _mean_of(rs, key)
        row["cut"] = sum(r.get("cut", 0) for r in rs)
        row["rejected"] = sum(r.get("rejected", 0) for r in rs)
        names = list(rs[0].get("nodes") or {})
        row["nodes"] = {n: {k: rounded(mean(r["nodes"][n][k] for r in rs
                                            if r["nodes"].get(n, {}).get(k) is not None), 3)
                            for k in ("token_share", "deferred_mean")} for n in names}
        rows.append(row)
    return rows


def _range(rs: Sequence[dict], key: str) -> dict:
    vals = [r[key] for r in rs if r.get(key) is not None]
    if not vals:
        return {"min": None, "max": None, "spread": None, "spread_pct": None}
    lo, hi, avg = min(vals), max(vals), sum(vals) / len(vals)
    return {"min": lo, "max": hi, "spread": rounded(hi - lo),
            "spread_pct": rounded(100 * (hi - lo) / avg, 1) if avg else None}


def _beyond(a: dict, b: dict, runs: int) -> bool | None:
    """Ranges ``a`` and ``b`` disjoint; ``None`` without values or with fewer than two
    repeats on a side (``runs``: the smaller repeat count)."""
    if runs < 2 or None in (a["min"], a["max"], b["min"], b["max"]):
        return None
    return a["max"] < b["min"] or b["max"] < a["min"]


def noise(runs: Sequence[dict], baseline: str = BASELINE) -> list[dict]:
    """Per (scenario, load, strategy): ``runs`` and, for each of :data:`NOISE_FIELDS`,
    min/max/spread/spread_pct over the repeats; for a strategy other than ``baseline``
    with a baseline group at the same scenario and load: ``delta_<field>`` (mean minus
    the baseline's mean) and ``beyond_noise_<field>`` (ranges disjoint; ``None``
    without values or with a single repeat on either side)."""
    by = groups(runs)
    out = []
    for (scenario, load, strategy), rs in by.items():
        row: dict = {"scenario": scenario, "load_fraction": load, "strategy": strategy,
                     "runs": len(rs)}
        for key in NOISE_FIELDS:
            row[key] = _range(rs, key)
        base = by.get((scenario, load, baseline))
        if strategy != baseline and base:
            for key in NOISE_FIELDS:
                a, b = _mean_of(rs, key), _mean_of(base, key)
                row[f"delta_{key}"] = rounded(a - b) if None not in (a, b) else None
                row[f"beyond_noise_{key}"] = _beyond(row[key], _range(base, key),
                                                     min(len(rs), len(base)))
        out.append(row)
    return out


def noise_summary(rows: Sequence[dict]) -> dict:
    """Median and maximum ``spread_pct`` of each noise field over the groups with at
    least two repeats (``None`` when there is none)."""
    out: dict = {"groups": sum(1 for r in rows if r["runs"] >= 2)}
    for key in NOISE_FIELDS:
        vals = [r[key]["spread_pct"] for r in rows
                if r["runs"] >= 2 and r[key]["spread_pct"] is not None]
        out[key] = {"median_spread_pct": rounded(median(vals), 1) if vals else None,
                    "max_spread_pct": max(vals) if vals else None}
    return out


# --------------------------------------------------------------------------- tables

def _num(v: float | None) -> str:
    """A number as :func:`bench.common.format_table` prints it (3 significant digits)."""
    if v is None:
        return "-"
    x = float(v)
    if x == 0:
        return "0"
    for bound, fmt in ((100, ".0f"), (10, ".1f"), (1, ".2f")):
        if abs(x) >= bound:
            return format(x, fmt)
    return format(x, ".3f")


def _load_cell(r: dict) -> str:
    return str(int(round(r["load_fraction"] * 100)))


def _split(r: dict, key: str, scale: float = 1.0) -> str:
    vals = [v.get(key) for v in (r.get("nodes") or {}).values()]
    return "/".join("-" if v is None else f"{v * scale:.0f}" if scale != 1 else _num(v)
                    for v in vals)


def table(runs: Sequence[dict]) -> str:
    """Means over repeats (:func:`aggregate`) as a Markdown table; per-node columns in
    pool order."""
    rows = aggregate(runs)
    names = "/".join((rows[0].get("nodes") or {}).keys()) if rows else ""
    cols = [("scenario", "scenario"), ("load", "load %"), ("strategy", "strategy"),
            ("runs", "runs"), ("offered_rps", "offered/s"), ("sent_rps", "sent/s"),
            ("goodput_rps", "goodput/s"),
            ("p50_s", "p50 s"), ("p99_s", "p99 s"), ("ttft_p50_s", "TTFT p50 s"),
            ("ttft_p90_s", "TTFT p90 s"), ("timeout_pct", "timeouts %"),
            ("rejected_pct", "429 %"), ("cut", "cut"), ("share", f"tokens % {names}"),
            ("deferred", f"queued in node {names}")]
    out = []
    for r in rows:
        out.append({**r, "load": _load_cell(r),
                    "timeout_pct": rounded((r["timeout_rate"] or 0) * 100, 1),
                    "rejected_pct": rounded((r["rejected_rate"] or 0) * 100, 1),
                    "share": _split(r, "token_share", 100.0),
                    "deferred": _split(r, "deferred_mean")})
    return format_table(out, cols)


def _minmax(d: dict) -> str:
    return "-" if d["min"] is None else f"{_num(d['min'])}-{_num(d['max'])}"


def _beyond_cell(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def noise_table(runs: Sequence[dict], baseline: str = BASELINE) -> str:
    """:func:`noise` as a Markdown table: min-max over repeats, the spread in % of the
    mean, and each strategy's difference from ``baseline`` with "beyond noise"."""
    cols = [("scenario", "scenario"), ("load", "load %"), ("strategy", "strategy"),
            ("runs", "runs"), ("g", "goodput/s min-max"), ("gs", "spread %"),
            ("p50", "p50 s min-max"), ("p99", "p99 s min-max"), ("p99s", "spread %"),
            ("t90", "TTFT p90 s min-max"), ("dg", f"Δ goodput vs {baseline}"),
            ("bg", "beyond noise"), ("dp", f"Δ p99 vs {baseline}"), ("bp", "beyond noise")]
    out = []
    for r in noise(runs, baseline):
        out.append({
            "scenario": r["scenario"], "load": _load_cell(r), "strategy": r["strategy"],
            "runs": r["runs"], "g": _minmax(r["goodput_rps"]),
            "gs": r["goodput_rps"]["spread_pct"], "p50": _minmax(r["p50_s"]),
            "p99": _minmax(r["p99_s"]), "p99s": r["p99_s"]["spread_pct"],
            "t90": _minmax(r["ttft_p90_s"]),
            "dg": r.get("delta_goodput_rps"), "bg": _beyond_cell(r.get("beyond_noise_goodput_rps"))
            if "delta_goodput_rps" in r else "", "dp": r.get("delta_p99_s"),
            "bp": _beyond_cell(r.get("beyond_noise_p99_s")) if "delta_p99_s" in r else ""})
    return format_table(out, cols)


def noise_line(runs: Sequence[dict]) -> str:
    """One sentence: the median and largest spread between repeats of goodput and p99."""
    s = noise_summary(noise(runs))
    if not s["groups"]:
        return "noise: one repeat per strategy, no spread to show"
    g, p = s["goodput_rps"], s["p99_s"]
    return (f"noise (spread between repeats of the same strategy, {s['groups']} groups): goodput "
            f"median {_num(g['median_spread_pct'])} %, max {_num(g['max_spread_pct'])} %; "
            f"p99 median {_num(p['median_spread_pct'])} %, max {_num(p['max_spread_pct'])} %")


def freeze_table(runs: Sequence[dict]) -> str:
    """The freeze runs (``--freeze``), one row each: requests, failures (timeouts +
    errors + 429), the send times (s after the freeze) of the requests that tried the
    frozen node while it was frozen, when the edge showed it stalled, and the failed
    requests that never received a byte ("" when there is no freeze run)."""
    rows = [r for r in runs if r["scenario"] == "freeze"]
    if not rows:
        return ""
    cols = [("strategy", "strategy"), ("repeat", "repeat"), ("load", "load %"),
            ("frozen_node", "frozen node"), ("freeze_s", "frozen s"), ("requests", "requests"),
            ("failures", "failures"), ("goodput_rps", "goodput/s"), ("sends", "sent to frozen"),
            ("at", "at s after the freeze"), ("found", "found stalled s"),
            ("lost_no_byte", "lost no byte")]
    out = []
    for r in rows:
        at = r.get("to_frozen_at_s") or []
        out.append({**r, "load": _load_cell(r),
                    "failures": r["timeouts"] + r["errors"] + r["rejected"],
                    "sends": len(at),
                    "at": " ".join(f"{x:g}" for x in at[:6]) + (" ..." if len(at) > 6 else "")
                    or "-",
                    "found": "-" if r.get("found_after_s") is None else r["found_after_s"]})
    return format_table(out, cols)


def report_text(data: dict, meta: dict) -> str:
    """What ``compare`` prints at the end, also the block of the performance page: the
    table, the noise table and line, the calibration and the run's note. ``data``: the
    ``realnode_compare.json`` document; ``meta``: its ``.meta.json``."""
    runs = data["runs"]
    cal = data["calibration"]
    per = ", ".join(f"{k} ({v['slots']} slots) {_num(v['rps'])}/s" for k, v in cal["nodes"].items())
    lines = [table(runs), "", noise_table(runs), "", noise_line(runs),
             f"capacity {_num(cal['capacity_rps'])} req/s ({per}; {cal.get('source', 'calibration')}"
             f"); window {meta['window_s']:g} s, deadline {meta['deadline_s']:g} s, "
             f"{meta['threads']} thread(s) per node"]
    frozen = freeze_table(runs)
    if frozen:
        lines += ["", frozen]
    if meta.get("note"):
        lines.append(f"note: {meta['note']}")
    return "\n".join(lines)
