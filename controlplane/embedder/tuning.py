"""Calibration of one domain's thresholds from labelled pairs (``infergate cache
calibrate``), and writing the result into the TOML configuration.

:func:`calibrate` embeds the pairs with the embedder's model, mines negatives for a
positives-only file (``calibration.mine_negatives``) and sweeps either

- the verifier's probability (candidates with cosine >= the verifier's floor that pass
  the precision guard, as the embedder serves them), when a
  verifier is given or trained (``train=True``: out-of-fold scores of a k-fold
  cross-validation on these pairs, then a verifier fitted on all of them), or
- the cosine, with the precision guard as a filter (no verifier),

and picks the lowest threshold whose wrong-hit rate has a 95 % upper bound <= ``max_wrong``
(``calibration.choose``).

:func:`write_domain` puts the result into ``[[cache.semantic_domains]]`` of the file
(replacing the entry with the same route / model / namespace prefix), validated before it
is written. The file is rewritten by ``tomli-w``: values are kept, comments are not.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomli_w

from controlplane.embedder import calibration as cal
from controlplane.errors import InfergateError
from controlplane.embedder import verifier as ver


class TuningError(InfergateError, ValueError):
    """Calibration cannot produce or store a result (message for the operator)."""


@dataclass
class CalibrationResult:
    """What :func:`calibrate` found. ``score`` is ``verifier`` or ``cosine``; ``rows`` the
    sweep; ``chosen`` the row picked (None: no threshold is safe enough);
    ``trained`` the verifier fitted on the pairs (``train=True``), else None."""

    score: str
    pairs: int
    positives: int
    negatives: int
    mined_negatives: int
    rows: list[cal.SweepRow]
    chosen: cal.SweepRow | None
    floor: float | None = None
    trained: ver.Verifier | None = None
    bound: str = "wilson"
    notes: list[str] = field(default_factory=list)


def _embed(model, texts: list[str], batch: int = 32) -> np.ndarray:
    if not texts:
        return np.zeros((0, model.dim), dtype=np.float32)
    return np.vstack([model.encode(texts[i:i + batch]) for i in range(0, len(texts), batch)])


def calibrate(pairs: cal.Pairs, model, max_wrong: float = 0.01,
              verifier: ver.Verifier | None = None, train: bool = False, folds: int = 5,
              bound: str = "wilson", seed: int = 7) -> CalibrationResult:
    """Sweep and choose a threshold on ``pairs`` (see the module docstring).

    ``model``: an ``EmbeddingModel``. Raises :class:`TuningError` when there are no
    matching pairs, or too few pairs to cross-validate a trained verifier."""
    if not 0.0 < max_wrong < 1.0:
        raise TuningError("--max-wrong must be between 0 and 1 (e.g. 0.01)")
    texts = sorted(set(pairs.text1) | set(pairs.text2))
    vecs = _embed(model, texts)
    pos = {t: i for i, t in enumerate(texts)}
    notes: list[str] = []
    if not any(v == 0 for v in pairs.label):
        pairs = cal.mine_negatives(pairs, vecs[[pos[t] for t in pairs.text1]],
                                   vecs[[pos[t] for t in pairs.text2]])
        notes.append(f"no labelled negatives: {sum(pairs.mined)} mined (closest question of "
                     "another paraphrase group); wrong-hit rates are upper bounds")
    y = np.array(pairs.label)
    if not (y == 1).any():
        raise TuningError("the pairs have no matching pair (label 1)")
    u = vecs[[pos[t] for t in pairs.text2]]
    v = vecs[[pos[t] for t in pairs.text1]]
    common = dict(pairs=len(y), positives=int((y == 1).sum()), negatives=int((y == 0).sum()),
                  mined_negatives=int(sum(pairs.mined)), bound=bound, notes=notes)
    if verifier is None and not train:
        from controlplane.embedder import guard

        cos = np.einsum("ij,ij->i", u, v)
        ok = np.array([guard.check(q, c).ok for q, c in zip(pairs.text2, pairs.text1)])
        rows = cal.sweep(cos, y, cal.grid(0.5, 1.0, 0.005), ok, bound=bound)
        return CalibrationResult("cosine", rows=rows, chosen=cal.choose(rows, max_wrong),
                                 **common)
    x = ver.features(pairs.text2, pairs.text1, u, v)
    cos = ver.cosine_of(x)
    guard_ok = ver.column(x, "guard_pass") > 0.5
    trained = None
    if train:
        floor = verifier.floor if verifier is not None else 0.5
        fold = cal.fold_ids(pairs, folds, seed)
        if len(np.unique(fold)) < 2:
            raise TuningError("too few distinct questions to cross-validate a verifier")
        own = sorted(set(pairs.text1))
        extra = ver.self_pairs(own, vecs[[pos[t] for t in own]], n=min(800, len(y)))
        try:
            scores = ver.cross_val_scores(x, y, fold, floor=floor, extra=extra)
        except ValueError as exc:
            raise TuningError(f"cannot train a verifier on these pairs: {exc}") from None
        rows = cal.sweep(scores, y, cal.grid(0.0, 1.0, 0.005), (cos >= floor) & guard_ok,
                         bound=bound)
        chosen = cal.choose(rows, max_wrong)
        keep = cos >= floor
        trained = ver.fit(np.vstack([x[keep], extra[0]]), np.concatenate([y[keep], extra[1]]),
                          model.dim, model.model_id,
                          min_score=chosen.threshold if chosen else 0.99, floor=floor)
        trained.trained_on = {"pairs": int(keep.sum())}
        trained.cv = {"folds": folds, "max_wrong": max_wrong,
                      "hit_rate": chosen.hit_rate if chosen else None,
                      "wrong_upper": chosen.wrong_upper if chosen else None}
        notes.append(f"verifier trained: thresholds from {folds}-fold cross-validation")
    else:
        assert verifier is not None
        floor = verifier.floor
        scores = verifier.score(pairs.text2, pairs.text1, u, v)
        rows = cal.sweep(scores, y, cal.grid(0.0, 1.0, 0.005), (cos >= floor) & guard_ok,
                         bound=bound)
        chosen = cal.choose(rows, max_wrong)
    return CalibrationResult("verifier", rows=rows, chosen=chosen, floor=floor,
                             trained=trained, **common)


def domain_entry(res: CalibrationResult, route: str = "", model: str = "",
                 namespace_prefix: str = "") -> dict:
    """The ``[[cache.semantic_domains]]`` table of a result with a chosen row."""
    if res.chosen is None:
        raise TuningError("no threshold reaches the target")
    d: dict = {}
    if route:
        d["route"] = route
    if model:
        d["model"] = model
    if namespace_prefix:
        d["namespace_prefix"] = namespace_prefix
    if res.score == "verifier":
        d["min_similarity"] = float(res.floor if res.floor is not None else 0.5)
        d["min_verifier_score"] = float(res.chosen.threshold)
    else:
        d["min_similarity"] = float(res.chosen.threshold)
        d["verifier"] = False
    d["pairs"] = res.pairs
    if res.chosen.hit_rate is not None:
        d["hit_rate"] = round(float(res.chosen.hit_rate), 5)
    d["wrong_hit_upper"] = round(float(res.chosen.wrong_upper), 5)
    return d


def write_domain(config_path: str | Path, entry: dict, verifier_file: str | None = None,
                 use_verifier: bool | None = None) -> None:
    """Replace or add ``entry`` in ``[[cache.semantic_domains]]`` of the TOML file (created
    when missing), optionally setting ``cache.verifier_file`` / ``cache.verifier``. The new
    document is validated first. Raises :class:`TuningError` (unreadable file, invalid
    result)."""
    from controlplane.config import ConfigError, settings_from_dict

    p = Path(config_path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8")) if p.exists() else {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TuningError(f"{p}: cannot read: {exc}") from None
    cache = doc.setdefault("cache", {})
    domains = [d for d in cache.get("semantic_domains", [])
               if (d.get("route", ""), d.get("model", ""), d.get("namespace_prefix", ""))
               != (entry.get("route", ""), entry.get("model", ""),
                   entry.get("namespace_prefix", ""))]
    domains.append(entry)
    cache["semantic_domains"] = domains
    if verifier_file is not None:
        cache["verifier_file"] = verifier_file
    if use_verifier is not None:
        cache["verifier"] = use_verifier
    try:
        settings_from_dict(doc, str(p))
    except ConfigError as exc:
        raise TuningError(str(exc)) from None
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(tomli_w.dumps(doc), encoding="utf-8")
    tmp.replace(p)


def plot(res: CalibrationResult, path: str | Path, title: str = "") -> bool:
    """Hit rate against the wrong-hit bound as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    xs = [r.wrong_upper * 100 for r in res.rows]
    ys = [(r.hit_rate or 0.0) * 100 for r in res.rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker=".", lw=1)
    if res.chosen is not None:
        ax.scatter([res.chosen.wrong_upper * 100], [(res.chosen.hit_rate or 0) * 100],
                   color="red", zorder=3, label=f"chosen {res.score} >= {res.chosen.threshold}")
        ax.legend()
    ax.set_xlabel("wrong-hit rate, 95 % upper bound (%)")
    ax.set_ylabel("hit rate on matching pairs (%)")
    ax.set_xlim(0, min(20, max(xs) if xs else 20))
    ax.grid(alpha=0.3)
    ax.set_title(title or f"semantic cache calibration ({res.score})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
