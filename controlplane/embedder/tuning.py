"""Calibration of one domain's thresholds from labelled pairs (``infergate cache
calibrate``), and writing the result into the TOML configuration.

:func:`calibrate` embeds the pairs with the embedder's model, mines negatives for a
positives-only file (``calibration.mine_negatives``), splits them by text into a *fit*
part (about 60 % of the question groups) and a *check* part (``split.split_pairs``: no
normalised text on both sides), and on the fit part sweeps either

- the verifier's probability (candidates with cosine >= the verifier's floor that pass
  the precision guard, as the embedder serves them), when a
  verifier is given or trained (``train=True``: out-of-fold scores of a k-fold
  cross-validation on the fit part, then a verifier fitted on all of it), or
- the cosine, with the precision guard as a filter (no verifier),

and picks the lowest threshold whose wrong-hit rate has a 95 % upper bound <= ``max_wrong``
(``calibration.choose``); the figures reported for that threshold come from the check
part, which took no part in the choice. A given verifier's training texts (its
fingerprint) must not make up more than :data:`MAX_OVERLAP` of the pairs
(:func:`check_overlap`); :func:`check_verdict` says when a result must not be written.

:func:`write_domain` puts the result into ``[[cache.semantic_domains]]`` of the file
(replacing the entry with the same route / model / namespace prefix), validated before it
is written. The file is rewritten by ``tomli-w``: values are kept, comments are not.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomli_w

from controlplane import filewrite
from controlplane.embedder import calibration as cal
from controlplane.embedder import decision, language
from controlplane.embedder import split
from controlplane.embedder import verifier as ver
from controlplane.errors import InfergateError


class TuningError(InfergateError, ValueError):
    """Calibration cannot produce or store a result (message for the operator)."""


CHECK_SALT = "infergate-calibrate-v1"
"""Salt of the fit / check split of an operator's pairs: not ``split.SPLIT_SALT``, so the
judge part of the dev data (one side of that split) still splits in two here."""
MAX_OVERLAP = 0.05
"""Largest share of the operator's distinct texts that may be in the verifier's training
data (its fingerprint) before :func:`calibrate` refuses (unless ``allow_overlap``)."""


@dataclass
class CalibrationResult:
    """What :func:`calibrate` found. ``score`` is ``verifier`` or ``cosine``; ``rows`` the
    sweep on the *fit* part; ``chosen`` the row picked there (None: no threshold is safe
    enough); ``check`` the *check* part's figures at that threshold (the bound to trust:
    those questions took no part in the choice, nor in training); ``trained`` the
    verifier fitted on the fit part (``train=True``), else None; ``baseline_check`` the
    given verifier on the check part at its own fit-part threshold (``train=True``);
    ``overlap`` ``(known, distinct)`` texts of the pairs in the verifier's training data.
    """

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
    fit_pairs: int = 0
    check_pairs: int = 0
    check: cal.SweepRow | None = None
    baseline_check: cal.SweepRow | None = None
    overlap: tuple[int, int] = (0, 0)
    languages: tuple[str, ...] = ()
    """The languages of the pairs' questions (:func:`pair_languages`)."""


def pair_languages(pairs: cal.Pairs, min_share: float = 0.02, min_texts: int = 5,
                   ) -> tuple[str, ...]:
    """The languages (:func:`language.detect`, sorted) of at least ``min_share`` of the
    distinct texts of ``pairs`` and at least ``min_texts`` of them: what a threshold
    calibrated on them was measured on (a text taken for another language now and then
    does not count)."""
    texts = set(pairs.text1) | set(pairs.text2)
    counts = Counter(language.detect(t) for t in texts)
    need = max(min_texts, min_share * len(texts))
    return tuple(sorted(lang for lang, n in counts.items()
                        if n >= need and lang != language.UNDETERMINED))


@dataclass
class _Part:
    """One part of the pairs, embedded: ``u`` the queries' (``text2``) vectors, ``v`` the
    cached texts' (``text1``)."""

    pairs: cal.Pairs
    u: np.ndarray
    v: np.ndarray
    y: np.ndarray


def _embed(model, texts: list[str], batch: int = 32) -> np.ndarray:
    if not texts:
        return np.zeros((0, model.dim), dtype=np.float32)
    return np.vstack([model.encode(texts[i:i + batch]) for i in range(0, len(texts), batch)])


def check_overlap(pairs: cal.Pairs, verifier: ver.Verifier | None,
                  allow: bool = False) -> tuple[int, int]:
    """``(known, distinct)``: the pairs' distinct normalised texts found in the verifier's
    training fingerprint. Raises :class:`TuningError` when more than :data:`MAX_OVERLAP`
    of them are known and ``allow`` is False: thresholds picked on texts the verifier was
    trained on hold their bound there and not on new questions."""
    if verifier is None:
        return 0, 0
    try:
        known, distinct = split.overlap(pairs.text1 + pairs.text2, verifier.training_hashes())
    except ver.VerifierError as exc:
        raise TuningError(str(exc)) from None
    if distinct and known / distinct > MAX_OVERLAP and not allow:
        raise TuningError(
            f"{known} of {distinct} distinct texts of these pairs ({known / distinct:.0%}) "
            "are in the verifier's training data: a threshold chosen and checked on them "
            "would not hold on new questions. Calibrate on pairs the verifier has not seen "
            f"(at most {MAX_OVERLAP:.0%} overlap), or pass --allow-overlap to go on anyway")
    return known, distinct


def _parts(pairs: cal.Pairs, model, notes: list[str]) -> tuple[_Part, _Part]:
    """Embed, split by text into fit and check parts (``split.split_pairs``), mine
    negatives within each part of a positives-only set. Raises :class:`TuningError` when
    a part lacks matching or non-matching pairs."""
    texts = sorted(set(pairs.text1) | set(pairs.text2))
    vecs = _embed(model, texts)
    pos = {t: i for i, t in enumerate(texts)}
    mask = split.split_pairs(pairs.text1, pairs.text2, salt=CHECK_SALT)
    mine = not any(v == 0 for v in pairs.label)
    out = []
    for side in (mask, ~mask):
        p = split.subset(pairs, side)
        if mine and len(p):
            p = cal.mine_negatives(p, vecs[[pos[t] for t in p.text1]],
                                   vecs[[pos[t] for t in p.text2]])
        y = np.array(p.label, dtype=np.int64)
        if not (y == 1).any() or not (y == 0).any():
            raise TuningError(
                "too few independent questions: split by text into a fit part and a check "
                f"part, one of them lacks matching or non-matching pairs ({int(side.sum())} "
                "pairs there); add pairs about other questions")
        out.append(_Part(p, vecs[[pos[t] for t in p.text2]].reshape(len(p), -1),
                         vecs[[pos[t] for t in p.text1]].reshape(len(p), -1), y))
    if mine:
        notes.append(f"no labelled negatives: {sum(out[0].pairs.mined) + sum(out[1].pairs.mined)}"
                     " mined (closest question of another paraphrase group, within each "
                     "part); wrong-hit rates are upper bounds")
    notes.append(f"split by text: {len(out[0].pairs)} pairs to choose on (fit), "
                 f"{len(out[1].pairs)} to check the choice on")
    return out[0], out[1]


def _at(rows: list[cal.SweepRow], threshold: float) -> cal.SweepRow:
    return next(r for r in rows if r.threshold == threshold)


def _cosine(fit: _Part, check: _Part, max_wrong: float, bound: str,
            ) -> tuple[list[cal.SweepRow], cal.SweepRow | None, cal.SweepRow | None]:
    from controlplane.embedder import guard

    out = []
    for part in (fit, check):
        cos = np.einsum("ij,ij->i", part.u, part.v)
        ok = np.array([guard.check(q, c).ok for q, c in zip(part.pairs.text2,
                                                             part.pairs.text1)])
        out.append(cal.sweep(cos, part.y, cal.grid(0.5, 1.0, 0.005), ok, bound=bound))
    chosen = cal.choose(out[0], max_wrong)
    return out[0], chosen, _at(out[1], chosen.threshold) if chosen else None


def _serving_guard(pairs: cal.Pairs) -> list:
    """Per pair (``text2`` asked, ``text1`` cached), the guard's verdict when the verifier
    decides, as the embedder serves (``decision.guard_verdict``)."""
    return [decision.guard_verdict(q, c, True) for q, c in zip(pairs.text2, pairs.text1)]


def _verifier_rows(v: ver.Verifier, part: _Part, bound: str) -> list[cal.SweepRow]:
    """The sweep of ``v``'s probability on ``part`` as the embedder serves: cosine >= the
    floor, the guard, then the probability (at least the guard's own bar for a pair:
    ``decision.served_score``)."""
    cos = np.einsum("ij,ij->i", part.u, part.v)
    verdicts = _serving_guard(part.pairs)
    allowed = (cos >= v.floor) & np.array([g.ok for g in verdicts], dtype=bool)
    scores = v.score(part.pairs.text2, part.pairs.text1, part.u, part.v)
    scores = np.array([decision.served_score(g, float(s)) for g, s in zip(verdicts, scores)])
    return cal.sweep(scores, part.y, cal.grid(0.0, 1.0, 0.005), allowed, bound=bound)


def _fixed(v: ver.Verifier, fit: _Part, check: _Part, max_wrong: float, bound: str,
           ) -> tuple[list[cal.SweepRow], cal.SweepRow | None, cal.SweepRow | None]:
    rows = _verifier_rows(v, fit, bound)
    chosen = cal.choose(rows, max_wrong)
    return rows, chosen, (_at(_verifier_rows(v, check, bound), chosen.threshold)
                          if chosen else None)


def _train(fit: _Part, check: _Part, model, max_wrong: float, floor: float, folds: int,
           bound: str, seed: int,
           ) -> tuple[list[cal.SweepRow], cal.SweepRow | None, cal.SweepRow | None,
                      ver.Verifier]:
    """A logistic verifier for the fit part: its threshold from out-of-fold scores of a
    k-fold cross-validation there, the model fitted on all of it; and its figures on the
    check part at that threshold."""
    x = ver.features(fit.pairs.text2, fit.pairs.text1, fit.u, fit.v)
    cos = ver.cosine_of(x)
    verdicts = _serving_guard(fit.pairs)
    guard_ok = np.array([g.ok for g in verdicts], dtype=bool)
    fold = cal.fold_ids(fit.pairs, folds, seed)
    if len(np.unique(fold)) < 2:
        raise TuningError("too few distinct questions to cross-validate a verifier")
    own_vec = dict(zip(fit.pairs.text1, fit.v))
    own = sorted(own_vec)
    extra = ver.self_pairs(own, np.vstack([own_vec[t] for t in own]), n=min(800, len(fit.y)))
    try:
        scores = ver.cross_val_scores(x, fit.y, fold, floor=floor, extra=extra)
    except ValueError as exc:
        raise TuningError(f"cannot train a verifier on these pairs: {exc}") from None
    served = np.array([decision.served_score(g, float(s)) for g, s in zip(verdicts, scores)])
    rows = cal.sweep(served, fit.y, cal.grid(0.0, 1.0, 0.005), (cos >= floor) & guard_ok,
                     bound=bound)
    chosen = cal.choose(rows, max_wrong)
    keep = cos >= floor
    trained = ver.fit(np.vstack([x[keep], extra[0]]), np.concatenate([fit.y[keep], extra[1]]),
                      model.dim, model.model_id,
                      min_score=chosen.threshold if chosen else 0.99, floor=floor)
    chk = _at(_verifier_rows(trained, check, bound), chosen.threshold) if chosen else None
    trained.trained_on = {"pairs": int(keep.sum()), "part": "fit"}
    trained.fingerprint = split.fingerprint(fit.pairs.text1 + fit.pairs.text2)
    trained.cv = {"folds": folds, "max_wrong": max_wrong,
                  "hit_rate": chosen.hit_rate if chosen else None,
                  "wrong_upper": chosen.wrong_upper if chosen else None,
                  "check_hit_rate": chk.hit_rate if chk else None,
                  "check_wrong_upper": chk.wrong_upper if chk else None}
    return rows, chosen, chk, trained


def calibrate(pairs: cal.Pairs, model, max_wrong: float = 0.01,
              verifier: ver.Verifier | None = None, train: bool = False, folds: int = 5,
              bound: str = "wilson", seed: int = 7,
              allow_overlap: bool = False) -> CalibrationResult:
    """Sweep and choose a threshold on the fit part of ``pairs``, report it on the check
    part (see the module docstring).

    ``model``: an ``EmbeddingModel``. Raises :class:`TuningError` when there are no
    matching pairs, too few independent questions to split, too few to cross-validate a
    trained verifier, or when the pairs overlap the verifier's training texts
    (:func:`check_overlap`; ``allow_overlap`` turns that into a warning note)."""
    if not 0.0 < max_wrong < 1.0:
        raise TuningError("--max-wrong must be between 0 and 1 (e.g. 0.01)")
    notes: list[str] = []
    pairs, same = cal.drop_same_text(pairs)
    if same:
        notes.append(f"{same} pairs of one text twice left out: the exact cache answers "
                     "such a repeat, no threshold decides it")
    if not any(v == 1 for v in pairs.label):
        raise TuningError("the pairs have no matching pair (label 1) of two different texts")
    known, distinct = check_overlap(pairs, verifier, allow_overlap)
    if distinct and known / distinct > MAX_OVERLAP:
        notes.append(f"WARNING: {known} of {distinct} texts ({known / distinct:.0%}) are in "
                     "the verifier's training data (--allow-overlap): its scores on them are "
                     "too good, the bounds below do NOT hold on new questions")
    fit, check = _parts(pairs, model, notes)
    y = np.concatenate([fit.y, check.y])
    common = dict(pairs=len(y), positives=int((y == 1).sum()), negatives=int((y == 0).sum()),
                  mined_negatives=int(sum(fit.pairs.mined) + sum(check.pairs.mined)),
                  bound=bound, notes=notes, fit_pairs=len(fit.y), check_pairs=len(check.y),
                  overlap=(known, distinct), languages=pair_languages(pairs))
    if verifier is None and not train:
        rows, chosen, chk = _cosine(fit, check, max_wrong, bound)
        return CalibrationResult("cosine", rows=rows, chosen=chosen, check=chk, **common)
    if not train:
        assert verifier is not None
        rows, chosen, chk = _fixed(verifier, fit, check, max_wrong, bound)
        return CalibrationResult("verifier", rows=rows, chosen=chosen, floor=verifier.floor,
                                 check=chk, **common)
    floor = verifier.floor if verifier is not None else 0.5
    rows, chosen, chk, trained = _train(fit, check, model, max_wrong, floor, folds, bound,
                                        seed)
    base = _fixed(verifier, fit, check, max_wrong, bound)[2] if verifier is not None else None
    notes.append(f"verifier trained on the fit part: threshold from {folds}-fold "
                 "cross-validation there")
    return CalibrationResult("verifier", rows=rows, chosen=chosen, floor=floor,
                             trained=trained, check=chk, baseline_check=base, **common)


def check_warning(res: CalibrationResult, max_wrong: float) -> str | None:
    """A warning when the threshold chosen on the fit part has a wrong-hit bound above
    ``max_wrong`` on the check part (None otherwise): the figures written are the check
    part's, the operator should add labelled pairs or ask for a lower ``max_wrong``."""
    if res.check is None or res.check.wrong_upper <= max_wrong:
        return None
    return (f"WARNING: on the check part the chosen threshold has a wrong-hit bound of "
            f"{res.check.wrong_upper:.2%} ({res.check.wrong} of {res.check.negatives} "
            f"non-matching pairs served), above {max_wrong:.2%}; the figures written are "
            "these. Add labelled pairs, or calibrate with a lower --max-wrong")


def check_verdict(res: CalibrationResult, max_wrong: float) -> str | None:
    """Why the result must not be written (None: it may): no safe threshold on the fit
    part, or a trained verifier that serves fewer matching pairs of the check part than
    the verifier it would replace (at that one's own threshold, within the bound)."""
    if res.chosen is None or res.check is None:
        return (f"no threshold keeps the wrong-hit bound at or under {max_wrong:.2%}: more "
                "labelled negatives are needed, or the score cannot separate this domain")
    base = res.baseline_check
    if res.trained is not None and base is not None and (res.check.hit_rate or 0.0) \
            < (base.hit_rate or 0.0) and base.wrong_upper <= max_wrong:
        return (f"too few pairs to beat the current verifier: on the check part the trained "
                f"one serves {(res.check.hit_rate or 0):.1%} of the matching pairs, the "
                f"current one {(base.hit_rate or 0):.1%}; keep the current one (calibrate "
                "without --train-verifier) or add labelled pairs")
    return None


def domain_entry(res: CalibrationResult, route: str = "", model: str = "",
                 namespace_prefix: str = "",
                 languages: Sequence[str] = language.GUARDED) -> dict:
    """The ``[[cache.semantic_domains]]`` table of a result with a chosen row.
    ``languages``: ``cache.semantic_languages`` of the configuration; when the pairs hold
    others, the domain's ``languages`` lists those and these (nothing when it holds
    ``"*"``)."""
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
    shown = res.check or res.chosen
    if shown.hit_rate is not None:
        d["hit_rate"] = round(float(shown.hit_rate), 5)
    d["wrong_hit_upper"] = round(float(shown.wrong_upper), 5)
    if language.ANY not in languages and set(res.languages) - set(languages):
        # measured on pairs of these languages: their questions may hit in this domain
        d["languages"] = sorted(set(res.languages) | set(languages))
    return d


def write_domain(config_path: str | Path, entry: dict, verifier_file: str | None = None,
                 use_verifier: bool | None = None) -> None:
    """Replace or add ``entry`` in ``[[cache.semantic_domains]]`` of the TOML file (created
    when missing), optionally setting ``cache.verifier_file`` /
    ``cache.verifier``. The new document is validated first; the file keeps its mode,
    owner and symbolic link (:func:`controlplane.filewrite.replace_file`). Raises :class:`TuningError`
    (unreadable or unwritable file, invalid result)."""
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
    try:
        filewrite.replace_file(p, tomli_w.dumps(doc).encode("utf-8"))
    except OSError as exc:
        raise TuningError(f"{p}: cannot write: {exc}") from None


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
