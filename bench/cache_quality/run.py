"""Semantic-cache quality: hit rate and wrong-hit rate across thresholds, with and without
the precision guard, for each available embedding model, on the labelled dev sets of
``shared/data/cache-eval`` (English ``qqp-en-paraphrases.jsonl``; Chinese ``bq-zh.tsv``,
``lcqmc-zh.tsv``, and the adversarial ``pawsx-zh.tsv``).

Run from the repository root::

    .venv/bin/python -m bench.cache_quality [--data DIR] [--models a,b] [--limit N]

Prints a table and writes ``bench/results/cache_quality.json``.

Two simulations, both with the service's own rule (cosine >= threshold, then the guard on
the query text vs the entry text; top 3 candidates, the first that passes is served):

1. **pair decision** (labelled ``.tsv`` sets): for every pair, the cache holds ``text1`` and
   is asked ``text2``. *hit rate* = share of matching pairs (label 1) served; *wrong-hit
   rate* = share of non-matching pairs (label 0) served. This is the figure the default
   threshold is chosen on, since only the labels say what is wrong.
2. **full cache** (every set): one namespace holds every distinct ``text1`` (qqp:
   ``origin``) and each ``text2`` (qqp: ``similar``) is looked up against all of them.
   A served entry is *right* when it is the query's labelled partner with label 1,
   *wrong (labelled)* when it is the partner with label 0, and *unverified* when it is
   another entry: the labels say nothing about it. For qqp, which has only matching pairs
   and many questions that recur in several wordings, texts are first grouped
   (union of pairs over identical normalised texts); an entry of the query's own group
   counts as right, one of another group as *other group* (an upper bound of wrong hits:
   some are recurrences the grouping could not link).

Default threshold per model (guard on, ``--target`` 1 %): for Chinese, the lowest threshold
(0.50-0.99, step 0.01) whose pair wrong-hit rate is <= target on both bq-zh and lcqmc-zh;
for English, the lowest whose qqp full-cache other-group rate is <= target; the default is
the larger (a model with no safe Chinese threshold is reported unfit for Chinese and gets
the English one). pawsx-zh is reported, not used: word-order swaps defeat both models.

Runtime on 2 cores: about 3-5 minutes for both models on all pairs (embedding dominates);
``--limit N`` takes a seeded random sample of N pairs per set. The learned verifier, which
the embedder applies by default on top of the guard, is evaluated by
``python -m bench.cache_quality.verifier`` (k-fold cross-validation).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "cache-eval"
RESULTS = ROOT / "bench" / "results" / "cache_quality.json"
THRESHOLDS = [round(0.50 + 0.01 * i, 2) for i in range(50)]
SHOWN = (0.80, 0.85, 0.90, 0.93, 0.95, 0.97)
CHINESE_GENERAL = ("bq-zh", "lcqmc-zh")
TOP_K = 3

sys.path.insert(0, str(ROOT))
from controlplane.embedder import calibration, guard  # noqa: E402
from controlplane.embedder.models import (MINILM, USE_M3, ModelLoadError,  # noqa: E402
                                          ModelSpec, load_model)


@dataclass
class PairSet:
    name: str
    lang: str
    text1: list[str]
    text2: list[str]
    label: list[int] | None  # None: positives only (qqp)


def load_sets(data: Path, limit: int | None, seed: int) -> list[PairSet]:
    """The four dev sets (missing files are skipped with a note)."""
    sets: list[PairSet] = []
    for name, fname, lang in (("bq-zh", "bq-zh.tsv", "zh"), ("lcqmc-zh", "lcqmc-zh.tsv", "zh"),
                              ("pawsx-zh", "pawsx-zh.tsv", "zh")):
        p = data / fname
        if not p.is_file():
            print(f"note: {p} missing, skipped", file=sys.stderr)
            continue
        rows = []
        with p.open(encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                try:
                    if row["text1"] and row["text2"] and row["label"] in ("0", "1"):
                        rows.append((row["text1"], row["text2"], int(row["label"])))
                except (KeyError, TypeError):
                    continue
        rows = _sample(rows, limit, seed)
        sets.append(PairSet(name, lang, [r[0] for r in rows], [r[1] for r in rows],
                            [r[2] for r in rows]))
    p = data / "qqp-en-paraphrases.jsonl"
    if p.is_file():
        rows = []
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                d = json.loads(line)
                if d.get("origin") and d.get("similar"):
                    rows.append((d["origin"], d["similar"]))
            except ValueError:
                continue
        rows = _sample(rows, limit, seed)
        sets.append(PairSet("qqp-en", "en", [r[0] for r in rows], [r[1] for r in rows], None))
    else:
        print(f"note: {p} missing, skipped", file=sys.stderr)
    return sets


def _sample(rows: list, limit: int | None, seed: int) -> list:
    if limit is None or len(rows) <= limit:
        return rows
    return random.Random(seed).sample(rows, limit)


def _norm(t: str) -> str:
    return calibration.normalise(t)


def qqp_groups(s: PairSet) -> dict[str, int]:
    """Normalised text -> group id: union-find over pairs sharing a normalised text
    (:func:`controlplane.embedder.calibration.groups` over every pair)."""
    return calibration.groups(s.text1, s.text2)


def served_index(sims: np.ndarray, ok: np.ndarray | None, t: float) -> np.ndarray:
    """Per query, the position (0..k-1) of the first candidate >= t that passes the guard
    (``ok`` None = no guard), or -1. ``sims``/``ok``: (Q, k), sorted by similarity."""
    allowed = sims >= t
    if ok is not None:
        allowed &= ok
    first = np.where(allowed.any(axis=1), allowed.argmax(axis=1), -1)
    # candidates are sorted: once one is below t, none after it is above
    return first


def evaluate(s: PairSet, enc) -> dict:
    texts = sorted(set(s.text1) | set(s.text2))
    pos = {t: i for i, t in enumerate(texts)}
    t0 = time.perf_counter()
    vecs = enc(texts)
    embed_s = time.perf_counter() - t0
    v1 = vecs[[pos[t] for t in s.text1]]
    v2 = vecs[[pos[t] for t in s.text2]]
    n = len(s.text1)
    # 1. pair decision
    pair_sim = np.einsum("ij,ij->i", v1, v2)
    pair_ok = np.array([guard.check(q, c).ok for q, c in zip(s.text2, s.text1)])
    # 2. full cache: entries = distinct text1
    entries = sorted(set(s.text1))
    epos = {t: i for i, t in enumerate(entries)}
    E = vecs[[pos[t] for t in entries]]
    sims = v2 @ E.T
    k = min(TOP_K, len(entries))
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    top_s = np.take_along_axis(sims, top, axis=1)
    order = np.argsort(-top_s, axis=1)
    top, top_s = np.take_along_axis(top, order, axis=1), np.take_along_axis(top_s, order, axis=1)
    top_ok = np.array([[guard.check(q, entries[j]).ok for j in row]
                       for q, row in zip(s.text2, top)])
    partner = np.array([epos[t] for t in s.text1])
    if s.label is not None:
        lab = np.array(s.label)
        posm, negm = lab == 1, lab == 0
    else:
        posm, negm = np.ones(n, bool), np.zeros(n, bool)
        groups = qqp_groups(s)
        qgroup = np.array([groups[_norm(t)] for t in s.text2])
        egroup = np.array([groups[_norm(t)] for t in entries])

    out: dict = {"pairs": n, "positives": int(posm.sum()), "negatives": int(negm.sum()),
                 "entries": len(entries), "embed_seconds": round(embed_s, 2)}
    for use_guard in (False, True):
        rows = []
        for t in THRESHOLDS:
            okp = pair_ok if use_guard else np.ones(n, bool)
            served_pair = (pair_sim >= t) & okp
            row = {"threshold": t,
                   "pair_hit_rate": _rate(served_pair, posm),
                   "pair_wrong_hit_rate": _rate(served_pair, negm) if negm.any() else None}
            idx = served_index(top_s, top_ok if use_guard else None, t)
            hit = idx >= 0
            chosen = np.where(hit, top[np.arange(n), np.maximum(idx, 0)], -1)
            if s.label is not None:
                is_partner = chosen == partner
                row["cache_hit_rate"] = _rate(hit & is_partner, posm)
                row["cache_wrong_hit_rate"] = _rate(hit & is_partner, negm)
                row["cache_unverified_rate"] = _rate(hit & ~is_partner, np.ones(n, bool))
            else:
                same = hit & (egroup[np.maximum(chosen, 0)] == qgroup)
                row["cache_hit_rate"] = _rate(same, posm)
                row["cache_other_group_rate"] = _rate(hit & ~same, posm)
            rows.append(row)
        out["guard_on" if use_guard else "guard_off"] = rows
    out["guard_pass_rate_positive_pairs"] = _rate(pair_ok, posm)
    if negm.any():
        out["guard_pass_rate_negative_pairs"] = _rate(pair_ok, negm)
    return out


def _rate(mask: np.ndarray, over: np.ndarray) -> float | None:
    total = int(over.sum())
    return None if total == 0 else round(float((mask & over).sum()) / total, 5)


def _lowest(sets: dict, names: list[str], field: str, target: float) -> float | None:
    for i, t in enumerate(THRESHOLDS):
        if all((sets[n]["guard_on"][i][field] or 0.0) <= target for n in names):
            return t
    return None


def recommend(sets: dict, target: float) -> dict:
    """Default threshold of one model (guard on).

    - Chinese: lowest threshold whose *pair* wrong-hit rate is <= target on both bq-zh and
      lcqmc-zh (labelled negatives).
    - English: qqp has no negatives; lowest threshold whose full-cache *other group* rate
      (an upper bound of wrong hits) is <= target.
    - default: the larger of the two; when no threshold <= 0.99 is safe for Chinese the
      model is marked unfit for Chinese and the English threshold is used."""
    zh_sets = [n for n in CHINESE_GENERAL if n in sets]
    t_zh = _lowest(sets, zh_sets, "pair_wrong_hit_rate", target) if zh_sets else None
    t_en = _lowest(sets, ["qqp-en"], "cache_other_group_rate", target) \
        if "qqp-en" in sets else None
    fit_zh = t_zh is not None
    chosen = [t for t in (t_en, t_zh) if t is not None]
    threshold = max(chosen) if chosen else None
    out: dict = {"threshold": threshold, "english": t_en, "chinese": t_zh,
                 "fit_for_chinese": fit_zh if zh_sets else None,
                 "target_wrong_hit_rate": target}
    if threshold is not None:
        i = THRESHOLDS.index(threshold)
        out["at_threshold"] = {n: {"guard_on": sets[n]["guard_on"][i],
                                   "guard_off": sets[n]["guard_off"][i]} for n in sets}
    return out


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{100 * x:5.1f}"


def print_table(model_id: str, res: dict) -> None:
    rec_ = res["recommended"]
    print(f"\n== {model_id}  (dim {res['dim']}): default threshold {rec_['threshold']} "
          f"(English {rec_['english']}, Chinese {rec_['chinese']}"
          f"{'' if rec_['fit_for_chinese'] is not False else ': no safe threshold, unfit'})")
    print("set       thr   | pair: hit% wrong%  guard: hit% wrong% | cache+guard: hit% "
          "wrong% unverified/other%")
    rec = res["recommended"]["threshold"]
    for name, r in res["sets"].items():
        for i, t in enumerate(THRESHOLDS):
            if t not in SHOWN and t != rec:
                continue
            a, g = r["guard_off"][i], r["guard_on"][i]
            other = g.get("cache_unverified_rate", g.get("cache_other_group_rate"))
            mark = "*" if t == rec else " "
            print(f"{name:9s} {t:.2f}{mark} |  {_pct(a['pair_hit_rate'])} "
                  f"{_pct(a['pair_wrong_hit_rate'])}   {_pct(g['pair_hit_rate'])} "
                  f"{_pct(g['pair_wrong_hit_rate'])}  |   {_pct(g['cache_hit_rate'])} "
                  f"{_pct(g.get('cache_wrong_hit_rate'))}  {_pct(other)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA,
                    help=f"folder of the dev sets (default {DEFAULT_DATA})")
    ap.add_argument("--models", default="",
                    help=f"comma list (default: every available of {MINILM}, {USE_M3})")
    ap.add_argument("--limit", type=int, default=None, help="sample N pairs per set")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--target", type=float, default=0.01,
                    help="wrong-hit rate the default threshold aims at (0-1)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not args.data.is_dir():
        print(f"error: dev-set folder {args.data} not found; pass --data DIR "
              "(it holds qqp-en-paraphrases.jsonl, bq-zh.tsv, lcqmc-zh.tsv, pawsx-zh.tsv)",
              file=sys.stderr)
        return 2
    sets = load_sets(args.data, args.limit, args.seed)
    if not sets:
        print(f"error: no dev set found in {args.data}", file=sys.stderr)
        return 2
    names = [m for m in args.models.split(",") if m] or [MINILM, USE_M3]
    report: dict = {"generated_at": time.time(), "data_dir": str(args.data.resolve()),
                    "limit": args.limit, "seed": args.seed, "top_k": TOP_K,
                    "thresholds": THRESHOLDS, "target_wrong_hit_rate": args.target,
                    "models": {}}
    t_all = time.perf_counter()
    for name in names:
        try:
            model = load_model(ModelSpec(model=name))
        except ModelLoadError as exc:
            print(f"note: model {name} not available: {exc}", file=sys.stderr)
            continue
        enc = model.encode
        res = {"dim": model.dim, "sets": {}}
        for s in sets:
            t0 = time.perf_counter()
            res["sets"][s.name] = evaluate(s, enc)
            print(f"{model.model_id}: {s.name} done in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr)
        res["recommended"] = recommend(res["sets"], args.target)
        report["models"][model.model_id] = res
        print_table(model.model_id, res)
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(f"\nwrote {args.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
