"""Semantic-cache quality of the serving path on questions the shipped artefacts have never
seen: hit rate and wrong-hit rate (with its 95 % upper bound) of the embedder's own
decision, on the *judge* part of the cache-eval dev sets.

Run from the repository root::

    .venv/bin/python -m bench.cache_quality [--data DIR] [--verifier FILE] [--limit N]

Prints a table and writes ``bench/results/cache_quality.json``.

Data: ``bq-zh``, ``lcqmc-zh``, ``pawsx-zh`` (labelled) and ``qqp-en`` (paraphrases only)
of ``shared/data/cache-eval``, split by text (``controlplane.embedder.split.split_sets``:
texts connected by any pair form one group, each group goes whole to the *fit* part,
about 60 % of the groups, or the *judge* part). The shipped verifier is trained and its
default threshold chosen on the fit part (``bench.cache_quality.verifier``); every figure
here is measured on the judge part, whose normalised texts the verifier never saw (its
file's fingerprint is checked: the overlap is printed). qqp-en gets one mined negative
per query (``calibration.mine_negatives``, within the judge part): its wrong-hit rates are
upper bounds. A pair of one text twice (equal after NFC; a few translated pairs of
pawsx-zh, labelled either way) is left out and counted (``same_text_left_out``): the
exact cache answers such a repeat, no semantic decision is made on it.

Decision: ``controlplane.embedder.decision.choose``, the function the embedder calls on
every lookup, with the embedder's defaults: the model ``use-multilingual-v3``, the
verifier's cosine floor, the precision guard and the model's unknown-character check, the
verifier and its ``min_score`` (its score is rescaled per query language and floored by
the plain-cosine points of the file: ``language_min_score``, ``language_min_cosine``, so
the thresholds of the sweep are on the score the decision uses). Two simulations:

1. **pair decision**: the cache holds ``text1`` and is asked ``text2``. *hit rate* = share
   of matching pairs (label 1) served; *wrong-hit rate* = share of non-matching pairs
   (label 0) served, with Wilson and Clopper-Pearson one-sided 95 % upper bounds. Also
   the sweep of the verifier threshold (what a lower or higher default would give: the
   *ceiling* row is the lowest threshold whose bound is <= 1 % on the judge part itself,
   an in-sample figure shown for comparison, not a default).
2. **full cache**: one namespace holds every distinct ``text1`` of the set; each ``text2``
   is looked up against all of them (top 3 by cosine, then the decision). Served entries
   are *right* (the labelled partner with label 1, or for qqp an entry of the query's
   group), *wrong* (the partner with label 0) or *other* (an entry the labels say nothing
   about; for qqp another group, an upper bound of wrong hits).

Runtime on 2 shared cores: about 1-2 minutes (embedding ~20 s, the verifier's features
~0.5 ms per pair).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "cache-eval"
RESULTS = ROOT / "bench" / "results" / "cache_quality.json"
FILES = (("bq-zh", "bq-zh.tsv"), ("lcqmc-zh", "lcqmc-zh.tsv"), ("pawsx-zh", "pawsx-zh.tsv"),
         ("qqp-en", "qqp-en-paraphrases.jsonl"))
TARGET_SETS = ("bq-zh", "lcqmc-zh", "qqp-en")
SWEEP = [round(0.50 + 0.0025 * i, 4) for i in range(201)]
SHOWN = (0.80, 0.85, 0.90, 0.95)
TOP_K = 3

sys.path.insert(0, str(ROOT))
from bench.cache_quality import embcache  # noqa: E402
from controlplane.embedder import calibration as cal  # noqa: E402
from controlplane.embedder import decision, split  # noqa: E402
from controlplane.embedder import verifier as ver  # noqa: E402
from controlplane.embedder.index import Candidate  # noqa: E402
from controlplane.embedder.models import USE_M3, ModelSpec, load_model  # noqa: E402


def load_sets(data: Path, part: str) -> dict[str, cal.Pairs]:
    """The dev sets present in ``data``, cut to ``part`` (``fit``, ``judge`` or ``all``)."""
    raw = {n: cal.load_pairs(data / f) for n, f in FILES if (data / f).is_file()}
    for n, f in FILES:
        if n not in raw:
            print(f"note: {data / f} missing, skipped", file=sys.stderr)
    if part == "all" or not raw:
        return raw
    masks = split.split_sets(raw)
    return {n: split.subset(p, masks[n] if part == "fit" else ~masks[n])
            for n, p in raw.items()}


def _sample(p: cal.Pairs, limit: int | None, seed: int) -> cal.Pairs:
    if limit is None or len(p) <= limit:
        return p
    keep = np.zeros(len(p), bool)
    keep[random.Random(seed).sample(range(len(p)), limit)] = True
    return split.subset(p, keep)


def _bounds(k: int, n: int) -> dict:
    return {"wilson": round(cal.wilson_upper(k, n), 5),
            "clopper_pearson": round(cal.clopper_pearson_upper(k, n), 5)}


def pair_decisions(p: cal.Pairs, vecs: dict[str, np.ndarray], v: ver.Verifier,
                   unknown) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair (``text1`` cached, ``text2`` asked): served at the shipped ``min_score``,
    passed everything but the verifier's threshold, and the verifier's score (nan when
    not scored)."""
    n = len(p)
    served = np.zeros(n, bool)
    reached = np.zeros(n, bool)
    score = np.full(n, np.nan)
    for i, (a, b) in enumerate(zip(p.text1, p.text2)):
        u, w = vecs[b], vecs[a]
        cand = [Candidate(str(i), float(u @ w), a, w)]
        hit, _, s = decision.choose(b, u, cand, v.floor, 0.0, True, v, unknown=unknown)
        reached[i] = hit is not None
        score[i] = np.nan if s is None else s
        hit, _, _ = decision.choose(b, u, cand, v.floor, v.min_score, True, v,
                                    unknown=unknown)
        served[i] = hit is not None
    return served, reached, score


def _rates(served: np.ndarray, y: np.ndarray) -> dict:
    pos, neg = y == 1, y == 0
    h, w = int((served & pos).sum()), int((served & neg).sum())
    npos, nneg = int(pos.sum()), int(neg.sum())
    return {"hits": h, "positives": npos, "wrong": w, "negatives": nneg,
            "hit_rate": round(h / npos, 5) if npos else None,
            "wrong_rate": round(w / nneg, 5) if nneg else None,
            "wrong_upper": _bounds(w, nneg)}


def full_cache(p: cal.Pairs, vecs: dict[str, np.ndarray], v: ver.Verifier,
               unknown) -> dict:
    """The full-cache simulation (module docstring) at the shipped thresholds."""
    real = [i for i, m in enumerate(p.mined) if not m]
    t1, t2 = [p.text1[i] for i in real], [p.text2[i] for i in real]
    lab = [p.label[i] for i in real]
    entries = sorted(set(t1))
    E = np.vstack([vecs[t] for t in entries])
    groups = cal.groups(t1, t2, lab)
    right = wrong = other = 0
    for a, b, y in zip(t1, t2, lab):
        u = vecs[b]
        sims = E @ u
        top = np.argsort(-sims)[:TOP_K]
        cands = [Candidate(entries[j], float(sims[j]), entries[j], E[j]) for j in top]
        hit, _, _ = decision.choose(b, u, cands, v.floor, v.min_score, True, v,
                                    unknown=unknown)
        if hit is None:
            continue
        if hit.text == a:
            right, wrong = right + (y == 1), wrong + (y == 0)
        elif groups.get(cal.normalise(hit.text)) == groups.get(cal.normalise(b)) and y == 1:
            right += 1
        else:
            other += 1
    n = len(t1)
    return {"queries": n, "entries": len(entries), "right": right, "wrong_labelled": wrong,
            "other": other, "right_rate": round(right / n, 5) if n else None,
            "other_rate": round(other / n, 5) if n else None}


def evaluate(p: cal.Pairs, vecs: dict[str, np.ndarray], v: ver.Verifier, unknown) -> dict:
    """One set's figures: pair decision at the shipped thresholds, the sweep, full cache."""
    y = np.array(p.label)
    t0 = time.perf_counter()
    served, reached, score = pair_decisions(p, vecs, v, unknown)
    ms = (time.perf_counter() - t0) * 1000 / max(1, 2 * len(p))
    s = np.nan_to_num(score, nan=-1.0)
    rows = cal.sweep(s, y, SWEEP, reached)
    ceiling = cal.choose(rows, 0.01)
    return {"pairs": len(p), "mined_negatives": int(sum(p.mined)),
            "shipped": _rates(served, y),
            "sweep": [r.to_dict() for r in rows],
            "ceiling": None if ceiling is None else ceiling.to_dict(),
            "full_cache": full_cache(p, vecs, v, unknown),
            "decision_ms_per_pair": round(ms, 3)}


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{100 * x:5.1f}"


def print_table(model_id: str, res: dict) -> None:
    """The judge-part table of one model (also rendered into docs/performance.md)."""
    vinfo = res["verifier"]
    points = vinfo.get("language_min_score") or {}
    cosines = vinfo.get("language_min_cosine") or {}
    per_lang = "".join(f"; {lang}: verifier >= {t}"
                       + (f" or cosine >= {cosines[lang]}" if lang in cosines else "")
                       for lang, t in points.items())
    print(f"== {model_id}, verifier {vinfo['file']} (trained on the {vinfo['part']} part), "
          f"cosine >= {vinfo['floor']}, guard, verifier >= {vinfo['min_score']}{per_lang}; "
          f"{res['part']} part, fingerprint overlap {vinfo['overlap']}")
    print("set        pairs  neg | shipped: hit%  wrong%  95% bound (Wilson/CP) | full cache: "
          "right% other% | ceiling: thr  hit%")
    for name, r in res["sets"].items():
        sh, fc, ce = r["shipped"], r["full_cache"], r["ceiling"]
        b = sh["wrong_upper"]
        print(f"{name:9s} {r['pairs']:6d} {sh['negatives']:4d} |  {_pct(sh['hit_rate'])}"
              f"  {_pct(sh['wrong_rate'])}  {_pct(b['wilson'])}/{_pct(b['clopper_pearson'])}"
              f"       |     {_pct(fc['right_rate'])}  {_pct(fc['other_rate'])} |  "
              f"{ce['threshold'] if ce else '-':>4}  {_pct(ce['hit_rate'] if ce else None)}")
    print("verifier threshold sweep (pair decision): thr: hit% / wrong% (Wilson 95% bound)")
    for name, r in res["sets"].items():
        cells = [f"{row['threshold']:.2f}: {_pct(row['hit_rate']).strip()} / "
                 f"{_pct(row['wrong_rate']).strip()} ({_pct(row['wrong_upper']).strip()})"
                 for row in r["sweep"] if row["threshold"] in SHOWN]
        print(f"{name:9s} " + "  ".join(cells))


def _embed(model, texts: list[str]) -> dict[str, np.ndarray]:
    return dict(zip(texts, embcache.embed(model, texts)))


def run(data: Path, part: str, verifier_file: str | None, limit: int | None,
        seed: int) -> dict:
    """Evaluate every set of ``data``'s ``part``; returns the model's result dict."""
    model = load_model(ModelSpec(model=USE_M3))
    v = ver.load_for(model.model_id, model.dim, verifier_file)
    if v is None:
        raise SystemExit(f"error: no verifier for {model.model_id}")
    sets = {n: _sample(p, limit, seed) for n, p in load_sets(data, part).items()}
    texts = sorted({t for p in sets.values() for t in p.text1 + p.text2})
    t0 = time.perf_counter()
    vecs = _embed(model, texts)
    print(f"embedded {len(texts)} texts in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    known, distinct = split.overlap(texts, v.training_hashes())
    unknown = getattr(model, "unknown_chars", None)
    res: dict = {"dim": model.dim, "part": part, "sets": {},
                 "verifier": {"file": verifier_file or str(ver.bundled_path(model.model_id)
                                                         .relative_to(ROOT)),
                              "floor": v.floor, "min_score": v.min_score,
                              "language_min_score": v.language_min_score,
                              "language_min_cosine": v.language_min_cosine,
                              "part": sorted({str(t.get("part", "all"))
                                              for t in v.trained_on.values()
                                              if isinstance(t, dict)}) or ["unknown"],
                              "overlap": f"{known}/{distinct} texts"}}
    res["verifier"]["part"] = ",".join(res["verifier"]["part"])
    for n, p in sets.items():
        p, same = cal.drop_same_text(p)
        if not any(x == 0 for x in p.label):
            p = cal.mine_negatives(p, np.vstack([vecs[t] for t in p.text1]),
                                   np.vstack([vecs[t] for t in p.text2]))
        t0 = time.perf_counter()
        res["sets"][n] = evaluate(p, vecs, v, unknown)
        res["sets"][n]["same_text_left_out"] = same
        print(f"{n} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return {model.model_id: res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA,
                    help=f"folder of the dev sets (default {DEFAULT_DATA})")
    ap.add_argument("--part", choices=("judge", "fit", "all"), default="judge",
                    help="pairs measured (default judge: never seen by the shipped verifier)")
    ap.add_argument("--verifier", default=None,
                    help="verifier file (default: the one the package ships)")
    ap.add_argument("--limit", type=int, default=None, help="sample N pairs per set")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not args.data.is_dir():
        print(f"error: dev-set folder {args.data} not found; pass --data DIR "
              "(it holds qqp-en-paraphrases.jsonl, bq-zh.tsv, lcqmc-zh.tsv, pawsx-zh.tsv)",
              file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    load0 = round(os.getloadavg()[0], 2)
    models = run(args.data, args.part, args.verifier, args.limit, args.seed)
    if not any(r["sets"] for r in models.values()):
        print(f"error: no dev set found in {args.data}", file=sys.stderr)
        return 2
    report = {"generated_at": time.time(), "command": "python -m bench.cache_quality",
              "commit": _commit(), "loadavg_before": load0,
              "loadavg_after": round(os.getloadavg()[0], 2),
              "data_dir": str(args.data.resolve()), "part": args.part, "limit": args.limit,
              "seed": args.seed, "top_k": TOP_K,
              "split": {"salt": split.SPLIT_SALT, "fit_share": split.FIT_SHARE},
              "models": models, "seconds": round(time.perf_counter() - t_all, 1)}
    for model_id, res in models.items():
        print_table(model_id, res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(f"\nwrote {args.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
