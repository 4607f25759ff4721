"""Learned verifier of the semantic cache: k-fold cross-validated hit rates at a 95 % upper
bound of <= 1 % wrong hits on the cache-eval dev sets, against cosine + guard; and the
training of the verifier file the package ships.

Run from the repository root::

    .venv/bin/python -m bench.cache_quality.verifier [--data DIR] [--folds 5]
        [--model mlp|logistic] [--feature-version 2|1] [--write-verifier]

Prints a table, writes ``bench/results/cache_verifier.json`` and, with
``--write-verifier``, ``controlplane/embedder/data/verifier-use-multilingual-v3.json``
(``--update-thresholds`` writes only the chosen thresholds into the shipped file, keeping
its weights). ``--save-scores FILE`` keeps the out-of-fold scores; ``--scores-from FILE``
reads them back instead of training (the choice of the defaults reruns in seconds). The
dev sets' embeddings are kept on disk (``bench.cache_quality.embcache``).

Method (pair decision: the cache holds ``text1`` and is asked ``text2``):

- Pairs: ``bq-zh``, ``lcqmc-zh``, ``pawsx-zh`` with their labels; ``qqp-en`` (positives
  only) plus one mined negative per query: its closest ``text1`` of another group
  (``calibration.mine_negatives``). Groups join the texts of each pair and texts with one
  ``calibration.duplicate_key`` (equal sequences of content words: a rewording such as
  "What's ..." / "What is ...", "Which is best ..." / "Which is the best ..."), so a
  question that recurs in the set is not counted as a wrong hit on itself; the key uses no
  embedding model. Recurrences in looser wordings ("earn money from YouTube" / "through
  YouTube") are still mined, so qqp wrong-hit rates remain upper bounds.
- Folds: ``--folds`` folds per set by connected component of texts, lexical duplicates
  counting as one text (no query text of a held-out pair, nor a rewording of it, is seen
  in training). Each fold's pairs are scored by a verifier trained on the other folds of
  **all** sets (pairs with cosine >= the floor), plus 800 questions per set paired with
  themselves (``verifier.self_pairs``).
- Verifier (``--model``): ``mlp`` (default, what the package ships): the mean probability
  of five one-hidden-layer networks (32 ReLU units, L2 0.03, 300 full-batch Adam steps at
  0.01, seeds 0-4: :data:`MLP`); ``logistic``: the logistic regression (L2 0.003, 300
  steps) of file version 1. Features (``--feature-version``): 2 (default) adds the
  content-word features (``verifier.CONTENT_FEATURES``) to the embedding and guard features
  of version 1. These settings were picked from a small fixed grid (logistic with features
  1 and 2; one network with L2 0.001, 0.01, 0.03, 0.1 on features 2 and 0.03 on features
  1; three seeds at 0.03 alone and averaged; five averaged, shipped), every point run
  under this protocol.
- Per set, on the out-of-fold scores: the lowest threshold whose wrong-hit rate has a
  Wilson 95 % upper bound <= ``--max-wrong`` and the hit rate there, for (a) cosine with
  the precision guard as a filter, (b) the verifier as the service runs it (cosine >=
  floor, the guard, then the probability; also reported without the guard filter), each
  calibrated on that set (what ``infergate cache calibrate`` does for a domain); and
  (c) the shipped defaults: one operating point per query language
  (``verifier.language_of``: Chinese, other), chosen on the out-of-fold scores of that
  language's sets (bq-zh and lcqmc-zh; qqp-en) by :func:`operating_points`: a verifier
  threshold, optionally with a plain-cosine point (a pair that passes the guard with a
  cosine at or above it is served whatever the verifier says, so the verifier is never
  worse than plain cosine there), the pair with the highest mean hit rate while every set
  of the language keeps its bound. They go into the verifier file as
  ``language_min_score`` and ``language_min_cosine`` (``min_score``, the largest
  threshold, is the number a domain's ``min_verifier_score`` replaces).
  pawsx-zh is reported, never used to choose.
- The shipped verifier is then trained on every pair of every set of the part
  (``--write-verifier``), with the fingerprint of their texts (``split.fingerprint``).

Part (``--part``): ``fit`` by default, the ~60 % of the text groups of
``split.split_sets`` (texts joined by any pair; no normalised text in both parts) that
the shipped verifier is trained and its default threshold chosen on; ``bench.cache_quality``
measures the result on the other part, ``judge``. ``all`` uses every pair.

Thresholds are chosen on the same out-of-fold scores they are reported on (the
calibration an operator runs on their own pairs); the upper bound, not the observed rate,
keeps the choice conservative. Runtime on 2 shared cores: about 1 minute with
``--model logistic``, 5-8 minutes with ``mlp``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.cache_quality import embcache  # noqa: E402
from controlplane.embedder import calibration as cal  # noqa: E402
from controlplane.embedder import decision, guard, split  # noqa: E402
from controlplane.embedder import verifier as ver  # noqa: E402
from controlplane.embedder.models import USE_M3, ModelSpec, load_model  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "cache-eval"
RESULTS = ROOT / "bench" / "results" / "cache_verifier.json"
FILES = (("bq-zh", "bq-zh.tsv"), ("lcqmc-zh", "lcqmc-zh.tsv"), ("pawsx-zh", "pawsx-zh.tsv"),
         ("qqp-en", "qqp-en-paraphrases.jsonl"))
CHOOSE_ON = ("bq-zh", "lcqmc-zh", "qqp-en")
FLOOR = 0.5
L2 = 3e-3          # logistic regression
ITERS = 300
MLP = {"hidden": 32, "l2": 3e-2, "iters": 300, "lr": 0.01, "seeds": (0, 1, 2, 3, 4)}
AUGMENT = 800


def embed_all(model, texts: list[str]) -> np.ndarray:
    return embcache.embed(model, texts)


def _row(r: cal.SweepRow | None) -> dict | None:
    return None if r is None else r.to_dict()


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{100 * x:5.1f}"


def _cv_summary(args: argparse.Namespace, per: dict, names: list[str]) -> dict:
    """The ``cv`` block of the verifier file: figures at each set's default threshold."""
    return {"folds": args.folds, "max_wrong": args.max_wrong,
            "hit_rate_at_default": {n: per[n]["verifier_at_default"]["hit_rate"]
                                    for n in names if per[n]["verifier_at_default"]},
            "wrong_upper_at_default": {n: per[n]["verifier_at_default"]["wrong_upper"]
                                       for n in names if per[n]["verifier_at_default"]}}


def _served(score: np.ndarray, y: np.ndarray,
            mask: tuple[np.ndarray, np.ndarray, np.ndarray], t: float, c: float | None,
            ) -> dict:
    """Figures of the serving rule at verifier threshold ``t`` and plain-cosine point
    ``c`` (None: none): served = (the guard lets the verifier decide and the score >= t)
    or (the guard passes and the cosine >= c)."""
    verify_ok, guard_ok, cos = mask
    s = verify_ok & (score >= t)
    if c is not None:
        s |= guard_ok & (cos >= c)
    pos, neg = y == 1, y == 0
    h, w = int((s & pos).sum()), int((s & neg).sum())
    return {"threshold": t, "min_cosine": c, "hits": h, "positives": int(pos.sum()),
            "wrong": w, "negatives": int(neg.sum()),
            "hit_rate": h / max(1, int(pos.sum())), "wrong_rate": w / max(1, int(neg.sum())),
            "wrong_upper": cal.wilson_upper(w, int(neg.sum()))}


COSINE_POINTS: list[float | None] = [None]
"""Plain-cosine points tried with each verifier threshold (None: no plain-cosine rule).
Only None: with the points 0.95-1.0 tried as well, the choice on the fit part served
Chinese at verifier >= 0.965 or cosine >= 0.965-0.98: lcqmc-zh 20.8-31.4 %, bq-zh 2.2 %
and word-order swaps (pawsx-zh) 13.6-18.3 % wrong, which the verifier alone keeps near
1-2 %; ``--cosine-points`` tries them."""


def operating_points(oof: dict[str, np.ndarray], Y: dict[str, np.ndarray], masks: dict,
                     sets: dict[str, cal.Pairs], max_wrong: float,
                     points: list[float | None] | None = None,
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """The default operating point per query language (``verifier.language_of``),
    chosen on the out-of-fold scores: over a plain-cosine point (:data:`COSINE_POINTS`)
    and a verifier threshold (0.5-1 by 0.005), the pair whose mean hit rate over the
    :data:`CHOOSE_ON` sets of that language is highest while the wrong hits of those sets
    taken together (the language's traffic: for Chinese, bank and general questions)
    keep a Wilson bound <= ``max_wrong`` (ties: no plain-cosine rule, then the higher
    point). Each set's own bound is reported next to it; one set alone, with ~1 300
    negatives, moves by about 0.2 points of bound between trainings.
    Returns ``(threshold per language, plain-cosine point per language, where one is
    used)``; a language without a set gets neither (the file's ``min_score`` applies)."""
    points = COSINE_POINTS if points is None else points
    langs: dict[str, list[str]] = {}
    for n in CHOOSE_ON:
        if n in sets and len(sets[n]):
            langs.setdefault(ver.language_of(sets[n].text2[0]), []).append(n)
    thr, cosp = {}, {}
    grid = cal.grid(0.5, 1.0, 0.005)
    for lang, ns in langs.items():
        best: tuple[float, float, float | None] | None = None
        for c in points:
            for t in grid:
                rows = [_served(oof[n], Y[n], masks[n], t, c) for n in ns]
                pooled = cal.wilson_upper(sum(r["wrong"] for r in rows),
                                          sum(r["negatives"] for r in rows))
                if pooled <= max_wrong:
                    mean = float(np.mean([r["hit_rate"] for r in rows]))
                    if best is None or mean > best[0] + 1e-12:
                        best = (mean, t, c)
                    break
        if best is None:
            thr[lang] = 0.99
            continue
        thr[lang] = best[1]
        if best[2] is not None:
            cosp[lang] = best[2]
    return thr, cosp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--max-wrong", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--model", choices=("mlp", "logistic"), default="mlp",
                    help="verifier kind (default mlp; logistic is the version 1 model)")
    ap.add_argument("--feature-version", type=int, choices=ver.FEATURE_VERSIONS,
                    default=ver.FEATURE_VERSION,
                    help="1 leaves out the content-word features")
    ap.add_argument("--part", choices=("fit", "judge", "all"), default="fit",
                    help="pairs used (split.split_sets, by text): fit (default; what the "
                         "shipped verifier is trained on), judge, or all")
    ap.add_argument("--write-verifier", action="store_true",
                    help="train on all pairs and write the verifier file of the package")
    ap.add_argument("--update-thresholds", action="store_true",
                    help="keep the shipped verifier's weights; write only the thresholds "
                         "this run chooses (min_score, language_min_score) and its figures "
                         "into the shipped file")
    ap.add_argument("--save-scores", type=Path, default=None,
                    help="write the out-of-fold scores, labels and cosines (npz) here")
    ap.add_argument("--cosine-points", action="store_true",
                    help="also try plain-cosine points 0.95-1.0 with each threshold")
    ap.add_argument("--scores-from", type=Path, default=None,
                    help="read the out-of-fold scores of an earlier run's --save-scores "
                         "(same data, part, folds, seed and model) instead of training")
    args = ap.parse_args(argv)
    fv = args.feature_version

    def fit(x: np.ndarray, y: np.ndarray, dim: int, model_id: str, min_score: float = 0.5,
            ) -> ver.Verifier:
        if args.model == "mlp":
            return ver.fit_mlp(x, y, dim, model_id, min_score=min_score, floor=FLOOR, **MLP)
        return ver.fit(x, y, dim, model_id, min_score=min_score, floor=FLOOR, l2=L2,
                       iters=ITERS)
    if not args.data.is_dir():
        print(f"error: dev-set folder {args.data} not found; pass --data DIR", file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    model = load_model(ModelSpec(model=USE_M3))
    raw = {n: cal.load_pairs(args.data / f) for n, f in FILES if (args.data / f).is_file()}
    if not raw:
        print(f"error: no dev set in {args.data}", file=sys.stderr)
        return 2
    if args.part != "all":
        masks = split.split_sets(raw)
        raw = {n: split.subset(p, masks[n] if args.part == "fit" else ~masks[n])
               for n, p in raw.items()}
        print(f"{args.part} part: " + ", ".join(f"{n} {len(p)}" for n, p in raw.items()),
              file=sys.stderr)
    texts = sorted({t for p in raw.values() for t in p.text1 + p.text2})
    t0 = time.perf_counter()
    vecs = embed_all(model, texts)
    pos = {t: i for i, t in enumerate(texts)}
    print(f"embedded {len(texts)} texts in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sets: dict[str, cal.Pairs] = {}
    for n, p in raw.items():
        if not any(v == 0 for v in p.label):
            p = cal.mine_negatives(p, vecs[[pos[t] for t in p.text1]],
                                   vecs[[pos[t] for t in p.text2]])
        sets[n] = p
    t0 = time.perf_counter()
    X = {n: ver.features(p.text2, p.text1, vecs[[pos[t] for t in p.text2]],
                         vecs[[pos[t] for t in p.text1]], fv) for n, p in sets.items()}
    n_pairs = sum(len(p) for p in sets.values())
    feat_ms = (time.perf_counter() - t0) * 1000 / n_pairs
    Y = {n: np.array(p.label) for n, p in sets.items()}
    folds = {n: cal.fold_ids(p, args.folds, args.seed) for n, p in sets.items()}
    names = list(sets)
    # augmentation: per set, questions paired with themselves (label 1), drawn from the
    # training folds only
    def augment(k: int | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        xs, ys = [], []
        for n, p in sets.items():
            ts = sorted({p.text1[i] for i in range(len(p))
                         if not p.mined[i] and (k is None or folds[n][i] != k)})
            ax, ay = ver.self_pairs(ts, vecs[[pos[t] for t in ts]], AUGMENT, args.seed, fv)
            xs.append(ax)
            ys.append(ay)
        return xs, ys

    # pooled out-of-fold scores
    oof = {n: np.zeros(len(Y[n])) for n in names}
    t0 = time.perf_counter()
    if args.scores_from is not None:
        with np.load(args.scores_from) as z:
            for n in names:
                oof[n] = z[f"{n}/oof"].astype(np.float64)
                if len(oof[n]) != len(Y[n]) or not np.array_equal(z[f"{n}/y"], Y[n]):
                    print(f"error: {args.scores_from} does not hold this run's pairs of {n}",
                          file=sys.stderr)
                    return 2
        print(f"out-of-fold scores read from {args.scores_from}", file=sys.stderr)
    for k in range(0 if args.scores_from is not None else args.folds):
        tr = {n: (folds[n] != k) & (ver.cosine_of(X[n], fv) >= FLOOR) for n in names}
        ax, ay = augment(k)
        m = fit(np.vstack([X[n][tr[n]] for n in names] + ax),
                np.concatenate([Y[n][tr[n]] for n in names] + ay), model.dim, model.model_id)
        for n in names:
            te = folds[n] == k
            oof[n][te] = m.score_features(X[n][te])
        print(f"fold {k + 1}/{args.folds} done", file=sys.stderr)
    cv_s = time.perf_counter() - t0
    cos_grid = cal.grid(0.5, 1.0, 0.005)
    p_grid = cal.grid(0.0, 1.0, 0.005)
    per: dict = {}
    masks: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for n in names:
        cos = ver.cosine_of(X[n], fv)
        p = sets[n]
        verdicts = [decision.guard_verdict(q, c, True) for q, c in zip(p.text2, p.text1)]
        guard_ok = np.array([g == guard.PASS for g in verdicts])
        serve_ok = np.array([g.ok for g in verdicts])
        # texts with the same words (verifier.same_words) score 1 on the serving path
        oof[n][[ver.same_words(q, c) for q, c in zip(p.text2, p.text1)]] = 1.0
        a = cal.choose(cal.sweep(cos, Y[n], cos_grid, guard_ok), args.max_wrong)
        served = np.array([decision.served_score(g, float(x)) for g, x in zip(verdicts, oof[n])])
        v_rows = cal.sweep(served, Y[n], p_grid, (cos >= FLOOR) & serve_ok)
        free_rows = cal.sweep(oof[n], Y[n], p_grid, cos >= FLOOR)
        b_ = cal.choose(v_rows, args.max_wrong)
        masks[n] = ((cos >= FLOOR) & serve_ok, (cos >= FLOOR) & guard_ok, cos)
        per[n] = {"pairs": len(Y[n]), "positives": int(Y[n].sum()),
                  "negatives": int((Y[n] == 0).sum()),
                  "mined_negatives": int(sum(sets[n].mined)),
                  "cosine_guard": _row(a), "verifier": _row(b_),
                  "verifier_without_guard": _row(cal.choose(free_rows, args.max_wrong)),
                  "verifier_rows": [r.to_dict() for r in v_rows]}
    by_lang, by_cos = operating_points(
        oof, Y, masks, sets, args.max_wrong,
        [None] + [round(0.95 + 0.005 * i, 3) for i in range(11)] if args.cosine_points
        else None)
    default = max(by_lang.values()) if by_lang else 0.99
    for n in names:
        lang = ver.language_of(sets[n].text2[0])
        t, c = by_lang.get(lang, default), by_cos.get(lang)
        per[n]["verifier_at_default"] = _served(oof[n], Y[n], masks[n], t, c)
        per[n]["default_threshold"], per[n]["default_min_cosine"] = t, c
    print(f"\nuse-multilingual-v3, {args.model} verifier (features v{fv}), {args.folds}-fold CV, "
          f"hit rate (%) at the lowest threshold "
          f"whose wrong-hit rate has a 95 % upper bound <= {100 * args.max_wrong:.0f} %")
    print("shipped defaults per language: verifier >= "
          + ", ".join(f"{k} {t:.3f}" for k, t in by_lang.items())
          + "; plain cosine >= " + (", ".join(f"{k} {c:.3f}" for k, c in by_cos.items())
                                    or "none"))
    print("set        pairs  | cosine+guard: thr  hit%  | verifier: thr  hit% | "
          "shipped defaults: hit% wrong% (95% UB)")
    for n in names:
        r = per[n]
        a, b_, d = r["cosine_guard"], r["verifier"], r["verifier_at_default"]
        print(f"{n:9s} {r['pairs']:6d}  |  {a['threshold'] if a else '-':>14}"
              f" {_pct(a['hit_rate'] if a else None)}  |  {b_['threshold'] if b_ else '-':>10}"
              f" {_pct(b_['hit_rate'] if b_ else None)} |  {_pct(d['hit_rate'])}"
              f" {_pct(d['wrong_rate'])} ({_pct(d['wrong_upper']).strip()})")
    report = {"generated_at": time.time(), "model_id": model.model_id,
              "data_dir": str(args.data.resolve()), "folds": args.folds, "seed": args.seed,
              "max_wrong": args.max_wrong, "bound": "wilson 95% one-sided", "floor": FLOOR,
              "model": args.model, "feature_version": fv, "part": args.part,
              "hyperparameters": ({**MLP, "seeds": list(MLP["seeds"])} if args.model == "mlp"
                                  else {"l2": L2, "iters": ITERS}),
              "self_pairs_per_set": AUGMENT,
              "default_min_score": default, "language_min_score": by_lang,
              "language_min_cosine": by_cos,
              "scores_from": str(args.scores_from) if args.scores_from else None,
              "feature_ms_per_pair": round(feat_ms, 3), "cv_seconds": round(cv_s, 1),
              "sets": {n: {k: v for k, v in r.items() if k != "verifier_rows"}
                       for n, r in per.items()}}
    if args.save_scores is not None:
        np.savez(args.save_scores, **{f"{n}/{k}": a for n in names for k, a in
                                      (("oof", oof[n]), ("y", Y[n]),
                                       ("cos", ver.cosine_of(X[n], fv)))})
    if args.update_thresholds:
        path = ver.bundled_path(model.model_id)
        v = ver.Verifier.load(path)
        v.min_score, v.language_min_score = default, by_lang
        v.language_min_cosine = by_cos
        v.cv = _cv_summary(args, per, names)
        v.save(path)
        report["verifier_file"] = str(path.relative_to(ROOT))
        print(f"wrote the thresholds into {path}")
    if args.write_verifier:
        t0 = time.perf_counter()
        tr = {n: ver.cosine_of(X[n], fv) >= FLOOR for n in names}
        ax, ay = augment(None)
        v = fit(np.vstack([X[n][tr[n]] for n in names] + ax),
                np.concatenate([Y[n][tr[n]] for n in names] + ay), model.dim,
                model.model_id, min_score=default)
        v.language_min_score, v.language_min_cosine = by_lang, by_cos
        v.trained_on = {n: {"pairs": int(tr[n].sum()), "file": f, "part": args.part}
                        for n, f in FILES if n in tr}
        v.fingerprint = split.fingerprint(t for p in sets.values() for i in range(len(p))
                                          if not p.mined[i] for t in (p.text1[i], p.text2[i]))
        v.cv = _cv_summary(args, per, names)
        path = ver.bundled_path(model.model_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        v.save(path)
        # the file stores the input weights of a network as float16: how far its scores move
        saved = ver.Verifier.load(path)
        drift = max(float(np.abs(saved.score_features(X[n]) - v.score_features(X[n])).max())
                    for n in names)
        report["verifier_file"] = str(path.relative_to(ROOT))
        report["saved_file_max_score_change"] = round(drift, 6)
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB, trained in "
              f"{time.perf_counter() - t0:.1f} s; scores of the saved file within "
              f"{drift:.1e} of the trained model)")
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
