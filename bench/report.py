"""The performance page and README's summary, generated from ``bench/results/*.json``.

    python -m bench.report            # rewrite every generated block of the pages
    python -m bench.report --check    # exit 1 (and name the pages) when one is stale

A page holds hand-written text and generated blocks. A block is everything between
``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``; the script replaces it
with the output of the block builder ``NAME`` (:data:`BLOCKS`) and leaves the text around
it alone, so the narrative is edited in the page and no table is edited by hand. Each
block names the result file it comes from and the commit, date and load average that
file records ("not recorded" where it records none), then the table as the benchmark
itself prints it (its own formatting functions are called on the stored JSON).

Pages: :data:`PAGES` (``docs/performance.md`` and ``README.md``). An
unknown block name, a start marker without its end, or a missing result file is a
:class:`ReportError`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import format_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGES = ("docs/performance.md", "README.md")
NOT_RECORDED = "not recorded"

_BLOCK = re.compile(r"(<!-- bench:(?P<name>[a-z0-9_]+):start -->\n)(?P<body>.*?)"
                    r"(<!-- bench:(?P=name):end -->)", re.S)
_START = re.compile(r"<!-- bench:([a-z0-9_]+):start -->")


class ReportError(Exception):
    """A page or a result file the report cannot use (the message says which)."""


# --------------------------------------------------------------------------- inputs

def load(results: Path, name: str) -> Any:
    """The parsed JSON of ``results/name``; :class:`ReportError` when it is missing."""
    path = results / name
    if not path.is_file():
        raise ReportError(f"{path}: result file missing")
    return json.loads(path.read_text(encoding="utf-8"))


def _when(meta: dict) -> str:
    if meta.get("started"):
        return str(meta["started"])
    if isinstance(meta.get("generated_at"), (int, float)):
        return time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(meta["generated_at"]))
    return NOT_RECORDED


def _load(meta: dict) -> str:
    machine = meta.get("machine") or {}
    before = meta.get("loadavg_before") or machine.get("loadavg_1m")
    if isinstance(before, list):
        before = before[0]
    after = meta.get("loadavg_after")
    if isinstance(after, list):
        after = after[0]
    if before is None and after is None:
        during = sorted(r["load_average_1m"] for r in (meta.get("throughput") or {}).values()
                        if r.get("load_average_1m") is not None)
        return f"{during[0]}-{during[-1]} during the run" if during else NOT_RECORDED
    text = f"{before} at the start" if before is not None else f"{NOT_RECORDED} at the start"
    return text + (f", {after} after" if after is not None else "")


def provenance(source: str, meta: dict) -> str:
    """One line: the result file, its command, commit, date and 1-minute load average,
    each "not recorded" when ``meta`` lacks it."""
    commit = meta.get("commit") or (meta.get("machine") or {}).get("commit")
    command = f" (`{meta['command']}`)" if meta.get("command") else ""
    commit_text = f"`{commit}`" if commit else NOT_RECORDED
    return (f"From `bench/results/{source}`{command}: commit {commit_text}, "
            f"date {_when(meta)}, load average (1 min) {_load(meta)}.")


def _fenced(*parts: str) -> str:
    return "```\n" + "\n".join(p.rstrip("\n") for p in parts if p) + "\n```"


def _captured(fn: Callable[..., None], *args: Any) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue().strip("\n")


# --------------------------------------------------------------------------- blocks

def _scheduler(results: Path, name: str, extra_lines: bool = False) -> str:
    from .scheduler import report

    records = load(results, f"{name}.json")
    meta = load(results, f"{name}.meta.json")
    lines = []
    if extra_lines:  # what bench.scheduler.scenarios prints under its table
        for r in records:
            if "by_model" in r:
                lines.append(f"{r['scenario']} {r['load_fraction'] * 100:.0f}% {r['strategy']}: "
                             + "; ".join(f"{m}: ok {v['ok']}, 404 {v['not_found']}, timeouts "
                                         f"{v['timeouts']}" for m, v in r["by_model"].items()))
    out = provenance(f"{name}.json", meta) + "\n\n" + _fenced(report.table(records))
    return out + ("\n\n" + _fenced("\n".join(lines)) if lines else "")


def _prefix(results: Path, name: str) -> str:
    from .scheduler import prefix

    records = load(results, f"{name}.json")
    meta = load(results, f"{name}.meta.json")
    return provenance(f"{name}.json", meta) + "\n\n" + _fenced(prefix.table(records))


def block_edge_overhead(results: Path) -> str:
    """``python -m bench.edge_overhead``'s table and target lines."""
    from .edge_overhead import __main__ as eo

    data = load(results, "edge_overhead.json")
    records, meta = data["rows"], data["meta"]
    unavailable = [f"{r['row']}: not available: {r['reason']}" for r in records
                   if not r["available"]]
    targets = eo.target_checks(records, data.get("checks", {}).get("all_hit"))
    tail = (f"wrk -t{meta.get('threads', 1)} --latency -d{meta.get('duration_s', 0):g}s, median of "
            f"{meta.get('rounds', '?')} rounds; {(meta.get('machine') or {}).get('nproc', '?')} CPUs; "
            f"commit {meta.get('commit') or NOT_RECORDED}; load average "
            f"{meta.get('loadavg_before', NOT_RECORDED)} before, "
            f"{meta.get('loadavg_after', NOT_RECORDED)} after")
    printed = "\n".join([format_table(eo.table_rows(records), eo.COLUMNS), *unavailable, "",
                          *targets, "", tail])
    return provenance("edge_overhead.json", meta) + "\n\n" + _fenced(printed)


def block_admission(results: Path) -> str:
    """``python -m bench.admission``'s table (shedding on and off)."""
    from .admission import run

    data = load(results, "admission.json")
    rows = [{**rec, "shed_pct": rec["shed_rate"] * 100, "timeout_pct": rec["timeout_rate"] * 100,
             "error_pct": rec["error_rate"] * 100} for rec in data["runs"]]
    return provenance("admission.json", data["meta"]) + "\n\n" + _fenced(
        format_table(rows, run.COLUMNS))


def block_redis_cluster(results: Path) -> str:
    """``python -m bench.cluster``'s table and drill lines (one Redis vs a loopback cluster)."""
    from .cluster import __main__ as cl

    data = load(results, "redis_cluster.json")
    return provenance("redis_cluster.json", data["meta"]) + "\n\n" + _fenced(
        _captured(cl.print_report, data))


def block_redis_cluster_failover(results: Path) -> str:
    """``python -m bench.cluster.failover``: the master-kill drill's phases by
    ``cluster-node-timeout``."""
    from .cluster import failover

    data = load(results, "redis_cluster_failover.json")
    return provenance("redis_cluster_failover.json", data["meta"]) + "\n\n" + _fenced(
        _captured(failover.print_report, data))


INDEX_COLUMNS = [("entries", "entries"), ("backend", "index"), ("p50_ms", "p50 ms"),
                 ("p99_ms", "p99 ms"), ("mean_ms", "mean ms"), ("n", "lookups")]


def block_cache_index(results: Path) -> str:
    """Index lookup latency by index size (``cache_latency.json``)."""
    data = load(results, "cache_latency.json")
    rows = [{"entries": int(n), "backend": backend, **res}
            for backend, sizes in data["index"].items() for n, res in sizes.items()]
    rows.sort(key=lambda r: (r["entries"], r["backend"]))
    return (provenance("cache_latency.json", data) + f" {data['dim']} dimensions, "
            f"top {data['top_k']}.\n\n" + _fenced(format_table(rows, INDEX_COLUMNS)))


THROUGHPUT_COLUMNS = [("model", "model"), ("args", "embedder args"), ("clients", "clients"),
                      ("lookups_per_s", "lookups/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
                      ("mean_batch_size", "batch"), ("load_average_1m", "load 1m")]
THROUGHPUT_FILES = ("cache_latency_wrk.json", "cache_latency_wrk_p1.json",
                    "cache_latency_minilm_wrk.json")


def block_cache_throughput(results: Path) -> str:
    """Embedder lookups/s by clients, one row per result file and client count."""
    rows, lines = [], []
    for name in THROUGHPUT_FILES:
        data = load(results, name)
        lines.append(provenance(name, data))
        for res in data["throughput"].values():
            rows.append({"model": data["throughput_model"],
                         "args": data.get("embedder_args") or "(defaults)", **res})
    return "\n".join(f"- {ln}" for ln in lines) + "\n\n" + _fenced(
        format_table(rows, THROUGHPUT_COLUMNS))


def _pct(x: float | None, digits: int = 1) -> str | None:
    return None if x is None else f"{100 * x:.{digits}f}"


def _point(s: dict) -> str | None:
    """A set's default operating point: the verifier threshold, and the plain-cosine
    point when one is used (``bench.cache_quality.verifier.operating_points``)."""
    t, c = s.get("default_threshold"), s.get("default_min_cosine")
    if t is None:
        return None
    return f"{t:.3f}" + (f" or cos {c:.3f}" if c is not None else "")


def _verifier_rows(data: dict) -> list[dict]:
    rows = []
    for name, s in data["sets"].items():
        a, v, d = s.get("cosine_guard"), s.get("verifier"), s.get("verifier_at_default")
        rows.append({
            "set": name, "pairs": s["pairs"],
            "cos_thr": a["threshold"] if a else None, "cos_hit": _pct(a["hit_rate"]) if a else None,
            "ver_thr": v["threshold"] if v else None, "ver_hit": _pct(v["hit_rate"]) if v else None,
            "def_point": _point(s),
            "def_hit": _pct(d["hit_rate"]) if d else None,
            "def_wrong": _pct(d["wrong_rate"], 2) if d else None,
            "def_bound": _pct(d["wrong_upper"], 2) if d else None})
    return rows


def _verifier_columns(default: float) -> list[tuple[str, str]]:
    return [("set", "set"), ("pairs", "pairs"), ("cos_thr", "cosine+guard: thr"),
            ("cos_hit", "hit %"), ("ver_thr", "verifier: thr"), ("ver_hit", "hit %"),
            ("def_point", "shipped defaults: point"), ("def_hit", "hit %"),
            ("def_wrong", "wrong %"), ("def_bound", "wrong 95% bound %")]


def block_cache_verifier(results: Path) -> str:
    """``python -m bench.cache_quality.verifier``'s table: hit rate at <= 1 % wrong
    (95 % bound) per domain, and at the shipped threshold."""
    data = load(results, "cache_verifier.json")
    head = (provenance("cache_verifier.json", data)
            + f" {data['model_id']}, {data['model']} verifier (features v{data['feature_version']}),"
            f" {data['folds']}-fold cross-validation, wrong-hit bound {data['bound']}"
            f" <= {100 * data['max_wrong']:.0f} %.")
    return head + "\n\n" + format_table(_verifier_rows(data),
                                        _verifier_columns(data["default_min_score"]))


def _summary_rows(data: dict) -> list[dict]:
    rows = []
    for model_id, res in data["models"].items():
        for name, s in res["sets"].items():
            sh, ceil = s["shipped"], s.get("ceiling")
            rows.append({
                "set": name, "pairs": s["pairs"], "hit": _pct(sh["hit_rate"]),
                "wrong": _pct(sh["wrong_rate"], 2),
                "bound": _pct(sh["wrong_upper"]["wilson"], 2),
                "ceiling": (f"{_pct(ceil['hit_rate'])} at {ceil['threshold']:g}"
                            if ceil else "none <= 1 %")})
        break  # the bundled model only
    return rows


def block_summary(results: Path) -> str:
    """README's one table: what the semantic cache serves out of the box, measured on
    the judge part of the dev data (questions the shipped verifier and threshold never
    saw) through the embedder's own decision, with the wrong hits and their 95 % bound."""
    data = load(results, "cache_quality.json")
    cols = [("set", "dev set"), ("pairs", "held-out pairs"),
            ("hit", "paraphrases served, shipped defaults (%)"),
            ("wrong", "wrong hits (%)"), ("bound", "wrong, 95 % bound (%)"),
            ("ceiling", "best one threshold (%), picked on these pairs")]
    return (format_table(_summary_rows(data), cols) + "\n\n"
            + provenance("cache_quality.json", data)
            + " Details: [docs/performance.md](docs/performance.md#semantic-cache-quality).")


def block_cache_quality(results: Path) -> str:
    """``python -m bench.cache_quality``'s tables (bare embedding models + guard)."""
    from .cache_quality import run

    data = load(results, "cache_quality.json")
    text = "\n\n".join(_captured(run.print_table, model_id, res)
                       for model_id, res in data["models"].items())
    return provenance("cache_quality.json", data) + "\n\n" + _fenced(text)


BURST_COLUMNS = [("burst", "burst"), ("requests", "requests"), ("semantic_hits", "semantic hits"),
                 ("share_pct", "share %"), ("bypass", "BYPASS"), ("miss", "MISS"),
                 ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("wall_ms", "wall ms")]
RUN_COLUMNS = [("run", "run"), ("commit", "commit"), ("started", "started"),
               ("load", "load 1m before / after"), ("shares", "semantic hits % per burst"),
               ("worst", "worst %")]


def _burst_rows(data: dict) -> list[dict]:
    return [{"burst": i + 1, "share_pct": round(100 * b["semantic_share"], 1), **b}
            for i, b in enumerate(data["bursts"])]


def block_semantic_burst(results: Path) -> str:
    """``python -m bench.edge_overhead.burst``: each burst of the last run, its check line,
    and the worst burst of each stored repeat run (``semantic_burst_runs/*``)."""
    data = load(results, "semantic_burst.json")
    out = (provenance("semantic_burst.json", data) + "\n\n"
           + _fenced(format_table(_burst_rows(data), BURST_COLUMNS), data.get("check", "")))
    runs = sorted(p.parent.name for p in (results / "semantic_burst_runs").glob("*/semantic_burst.json"))
    if runs:
        rows = []
        for run in runs:
            d = load(results, f"semantic_burst_runs/{run}/semantic_burst.json")
            shares = [100 * b["semantic_share"] for b in d["bursts"]]
            rows.append({"run": run, "commit": (d.get("machine") or {}).get("commit") or NOT_RECORDED,
                         "started": _when(d), "load": _load(d),
                         "shares": " / ".join(f"{s:.1f}" for s in shares),
                         "worst": f"{min(shares):.1f}"})
        out += ("\n\nRepeat runs, `bench/results/semantic_burst_runs/*/semantic_burst.json`:\n\n"
                + _fenced(format_table(rows, RUN_COLUMNS)))
    return out


def block_realnode_compare(results: Path, name: str = "realnode_compare") -> str:
    """``python -m bench.realnode compare``'s tables (means over repeats, noise; the
    freeze runs), from ``<name>.json`` and its ``.meta.json``."""
    from .realnode import compare_stats

    data = load(results, f"{name}.json")
    meta = load(results, f"{name}.meta.json")
    return (provenance(f"{name}.json", meta) + "\n\n"
            + _fenced(compare_stats.report_text(data, meta)))


def block_noisy_tenant(results: Path) -> str:
    """``python -m bench.scheduler.noisy``'s tables and targets (``noisy_tenant.json``)."""
    from .scheduler import noisy

    data = load(results, "noisy_tenant.json")
    meta = data.get("meta") or {}
    head = (f"pool capacity {data['capacity_rps']} requests/s (wall), quiet tenants "
            f"{data['rate_quiet_rps']}/s each, noisy tenant 10x; {meta.get('duration_s')} s "
            f"per run, time scale {meta.get('time_scale')}")
    return provenance("noisy_tenant.json", meta) + "\n\n" + _fenced(head, "",
                                                                      noisy.table_text(data))


def block_scheduler_shapes(results: Path) -> str:
    """``python -m bench.scheduler.shapes``'s tables (figures, shape figures, ratios)."""
    from .scheduler import shapes

    records = load(results, "scheduler_shapes.json")
    meta = load(results, "scheduler_shapes.meta.json")
    return provenance("scheduler_shapes.json", meta) + "\n\n" + _fenced(shapes.table(records))


def block_stream_survival(results: Path) -> str:
    """``python -m bench.stream_survival``'s tables (the drill, TTFT with holding on/off)."""
    from .stream_survival import run

    data = load(results, "stream_survival.json")
    return provenance("stream_survival.json", data["meta"]) + "\n\n" + _fenced(
        _captured(run.tables, data))


BLOCKS: dict[str, Callable[[Path], str]] = {
    "scheduler": lambda r: _scheduler(r, "scheduler"),
    "scheduler_scenarios": lambda r: _scheduler(r, "scheduler_scenarios", extra_lines=True),
    "scheduler_prefix": lambda r: _prefix(r, "scheduler_prefix"),
    "scheduler_prefix_200": lambda r: _prefix(r, "scheduler_prefix_200"),
    "scheduler_mixed": lambda r: _scheduler(r, "scheduler_scenarios_mixed"),
    "scheduler_mixed_firstsight": lambda r: _scheduler(r, "scheduler_scenarios_mixed_firstsight"),
    "scheduler_shapes": block_scheduler_shapes,
    "scheduler_guard_steady": lambda r: _scheduler(r, "scheduler_guard_steady"),
    "scheduler_guard_steady_long": lambda r: _scheduler(r, "scheduler_guard_steady_long"),
    "scheduler_guard_openai": lambda r: _scheduler(r, "scheduler_guard_openai"),
    "scheduler_guard_prefix": lambda r: _prefix(r, "scheduler_guard_prefix"),
    "realnode_compare": block_realnode_compare,
    "realnode_freeze": lambda r: block_realnode_compare(r, "realnode_freeze"),
    "realnode_freeze_plain": lambda r: block_realnode_compare(r, "realnode_freeze_plain"),
    "edge_overhead": block_edge_overhead,
    "admission": block_admission,
    "redis_cluster": block_redis_cluster,
    "redis_cluster_failover": block_redis_cluster_failover,
    "noisy_tenant": block_noisy_tenant,
    "stream_survival": block_stream_survival,
    "cache_index": block_cache_index,
    "cache_throughput": block_cache_throughput,
    "cache_verifier": block_cache_verifier,
    "cache_quality": block_cache_quality,
    "semantic_burst": block_semantic_burst,
    "summary": block_summary,
}


# --------------------------------------------------------------------------- pages

def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every generated block rebuilt from ``results``.

    Raises :class:`ReportError` for an unknown block name or a start marker whose end
    marker is missing."""
    found = {m.group("name") for m in _BLOCK.finditer(text)}
    for name in _START.findall(text):
        if name not in found:
            raise ReportError(f"block {name!r}: start marker without its end marker")
    unknown = sorted(found - BLOCKS.keys())
    if unknown:
        raise ReportError(f"unknown block(s) {unknown}; known: {sorted(BLOCKS)}")
    return _BLOCK.sub(lambda m: m.group(1) + BLOCKS[m.group("name")](results) + "\n" + m.group(4),
                      text)


def generate(root: Path = ROOT, results: Path | None = None) -> dict[Path, str]:
    """Every page of :data:`PAGES` under ``root`` as it should read: {path: text}."""
    res = results or root / "bench" / "results"
    return {root / p: render((root / p).read_text(encoding="utf-8"), res) for p in PAGES}


def main(argv: list[str] | None = None, root: Path = ROOT, results: Path | None = None) -> int:
    """Rewrite the pages under ``root`` from ``results`` (default ``root/bench/results``),
    or, with ``--check``, list the stale ones and return 1; 2 on a :class:`ReportError`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when a page differs from what the results give")
    args = ap.parse_args(argv)
    try:
        pages = generate(root, results)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stale = [p for p, text in pages.items() if p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(root)} (run python -m bench.report)")
        return 1 if stale else 0
    for p in stale:
        p.write_text(pages[p], encoding="utf-8")
        print(f"wrote {p.relative_to(root)}")
    if not stale:
        print("every page is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
