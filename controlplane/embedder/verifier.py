"""Learned verifier: between retrieval (cosine >= a floor) and serving, a small logistic
regression in numpy decides whether the cached question and the new one mean the same.

Features of a pair (query ``q`` with unit vector ``u``, candidate ``c`` with ``v``),
:data:`FEATURE_VERSION` 1, ``2 * dim + len(SCALAR_FEATURES)`` values:

- ``|u - v|`` and ``u * v`` (element-wise; ``dim`` each): which directions agree;
- scalars (:data:`SCALAR_FEATURES`): cosine and its square, the precision guard's signals
  (``guard.py``: numbers differ, negation in one text only, antonym conflict, swapped
  sides, key-term and key-character substitution, guard passes), lengths (log characters
  of each, min/max ratio), overlap (Jaccard of characters, of character bigrams and of
  key terms; key terms only in one text, counted), share of CJK characters.

Inference: ``sigmoid(w . (x - mean) / scale + b)``, a probability 0-1; texts equal up to
case, spaces and punctuation score 1. About 0.3 ms per pair on an idle core (the guard's
text checks dominate; their per-text results are cached). The model file is JSON (:meth:`Verifier.save`):
``{"version", "feature_version", "dim", "model_id", "mean", "scale", "w", "b",
"min_score", "floor", "trained_on", "cv"}``. ``min_score`` is the default operating point
(probability a hit needs), ``floor`` the cosine a candidate needs to be considered at all.
The package ships one for ``use-multilingual-v3`` (``data/verifier-use-multilingual-v3.json``,
trained by ``bench/cache_quality --train-verifier`` on the cache-eval dev sets);
``infergate cache calibrate --train-verifier`` fits one on an operator's pairs.

Errors: :class:`VerifierError` for a file that cannot be read or does not fit the model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from controlplane.embedder import guard
from controlplane.errors import InfergateError

FEATURE_VERSION = 1
FILE_VERSION = 1
DATA_DIR = Path(__file__).resolve().parent / "data"

SCALAR_FEATURES = (
    "cos", "cos2", "numbers_differ", "negation_differs", "antonym", "swapped", "key_terms",
    "key_chars", "guard_pass", "log_len_q", "log_len_c", "len_ratio", "char_jaccard",
    "bigram_jaccard", "term_jaccard", "terms_only_q", "terms_only_c", "cjk_share",
)

_CJK_RE = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_SPACE_RE = re.compile(r"\s+")


class VerifierError(InfergateError, ValueError):
    """A verifier file cannot be read, or does not fit the embedding model."""


_PLAIN_RE = re.compile(r"[\W_]+")


def _plain(text: str) -> str:
    """Lowercase text without spaces, punctuation and symbols."""
    return _PLAIN_RE.sub("", text[:guard.MAX_GUARD_CHARS].lower())


def _jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def scalar_features(query: str, candidate: str, cos: float) -> list[float]:
    """The :data:`SCALAR_FEATURES` of one pair (texts cut to the guard's limit)."""
    q = query[:guard.MAX_GUARD_CHARS]
    c = candidate[:guard.MAX_GUARD_CHARS]
    ql, cl = _SPACE_RE.sub(" ", q.lower()).strip(), _SPACE_RE.sub(" ", c.lower()).strip()
    numbers = guard.numbers_key(q) != guard.numbers_key(c)
    negation = guard.negated(q) != guard.negated(c)
    antonym = guard.antonym_conflict(q, c) is not None
    swapped = guard.swapped(q, c)
    kt = guard.key_term_substitution(q, c)
    kc = guard.key_char_substitution(q, c)
    passes = not (numbers or negation or antonym or swapped or kt)
    tq, tc = guard._key_terms(q), guard._key_terms(c)
    bq = {ql[i:i + 2] for i in range(len(ql) - 1)}
    bc = {cl[i:i + 2] for i in range(len(cl) - 1)}
    lq, lc = max(1, len(ql)), max(1, len(cl))
    cjk = len(_CJK_RE.findall(ql)) + len(_CJK_RE.findall(cl))
    return [cos, cos * cos, float(numbers), float(negation), float(antonym), float(swapped),
            float(kt), float(kc), float(passes), math.log(lq), math.log(lc),
            min(lq, lc) / max(lq, lc), _jaccard(set(ql) - {" "}, set(cl) - {" "}),
            _jaccard(bq, bc), _jaccard(tq, tc), float(min(len(tq - tc), 5)),
            float(min(len(tc - tq), 5)), cjk / (lq + lc)]


def features(queries: Sequence[str], candidates: Sequence[str], u: np.ndarray,
             v: np.ndarray) -> np.ndarray:
    """(n, 2 * dim + len(SCALAR_FEATURES)) float32 features of n pairs; ``u``/``v`` are the
    (n, dim) L2-normalised vectors of ``queries``/``candidates``."""
    u = np.asarray(u, dtype=np.float32).reshape(len(queries), -1)
    v = np.asarray(v, dtype=np.float32).reshape(len(candidates), -1)
    cos = np.einsum("ij,ij->i", u, v)
    scal = np.array([scalar_features(q, c, float(s))
                     for q, c, s in zip(queries, candidates, cos)], dtype=np.float32)
    return np.hstack([np.abs(u - v), u * v, scal.reshape(len(queries), -1)])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0)))


@dataclass
class Verifier:
    """A trained logistic regression over :func:`features` (see the module docstring)."""

    dim: int
    model_id: str
    mean: np.ndarray
    scale: np.ndarray
    w: np.ndarray
    b: float
    min_score: float = 0.5
    floor: float = 0.5
    trained_on: dict = field(default_factory=dict)
    cv: dict = field(default_factory=dict)

    def score_features(self, x: np.ndarray) -> np.ndarray:
        """Probabilities (n,) for a feature matrix (n, F)."""
        x = np.asarray(x, dtype=np.float32)
        return _sigmoid(((x - self.mean) / self.scale) @ self.w + self.b)

    def score(self, queries: Sequence[str], candidates: Sequence[str], u: np.ndarray,
              v: np.ndarray) -> np.ndarray:
        """Probability (n,) that each query means the same as its candidate."""
        if len(queries) == 0:
            return np.zeros(0, dtype=np.float64)
        p = self.score_features(features(queries, candidates, u, v))
        # the same words up to case, spacing and punctuation: the same question
        same = [_plain(q) == _plain(c) and _plain(q) != "" for q, c in zip(queries, candidates)]
        return np.where(same, 1.0, p)

    def to_dict(self) -> dict:
        return {"version": FILE_VERSION, "feature_version": FEATURE_VERSION, "dim": self.dim,
                "model_id": self.model_id, "min_score": self.min_score, "floor": self.floor,
                "b": float(self.b), "w": [round(float(x), 6) for x in self.w],
                "mean": [round(float(x), 6) for x in self.mean],
                "scale": [round(float(x), 6) for x in self.scale],
                "trained_on": self.trained_on, "cv": self.cv}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False) + "\n",
                              encoding="utf-8")

    @classmethod
    def from_dict(cls, d: dict) -> "Verifier":
        """Raises :class:`VerifierError` for a wrong version or inconsistent sizes."""
        try:
            if d.get("version") != FILE_VERSION or d.get("feature_version") != FEATURE_VERSION:
                raise VerifierError(f"verifier file version {d.get('version')}/"
                                    f"{d.get('feature_version')}, expected {FILE_VERSION}/"
                                    f"{FEATURE_VERSION}")
            dim = int(d["dim"])
            n = 2 * dim + len(SCALAR_FEATURES)
            w = np.asarray(d["w"], dtype=np.float32)
            mean = np.asarray(d["mean"], dtype=np.float32)
            scale = np.asarray(d["scale"], dtype=np.float32)
            if not (w.shape == mean.shape == scale.shape == (n,)) or (scale <= 0).any():
                raise VerifierError(f"verifier file: expected {n} weights, means and "
                                    "positive scales")
            return cls(dim, str(d["model_id"]), mean, scale, w, float(d["b"]),
                       float(d["min_score"]), float(d["floor"]),
                       dict(d.get("trained_on") or {}), dict(d.get("cv") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, VerifierError):
                raise
            raise VerifierError(f"verifier file not understood: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Verifier":
        """Read a verifier JSON file. Raises :class:`VerifierError`."""
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise VerifierError(f"{path}: cannot read the verifier: {exc}") from None
        if not isinstance(d, dict):
            raise VerifierError(f"{path}: not a verifier file")
        return cls.from_dict(d)


def bundled_path(model_id: str) -> Path:
    """Path of the verifier shipped for ``model_id`` (may not exist)."""
    return DATA_DIR / f"verifier-{re.sub(r'[^a-z0-9._-]+', '-', model_id.lower())}.json"


def load_for(model_id: str, dim: int, path: str | Path | None = None) -> Verifier | None:
    """The verifier at ``path`` (else the bundled one for ``model_id``), checked against the
    model; None when no path is given and nothing is bundled for the model. Raises
    :class:`VerifierError` when the file is bad or was trained for another model."""
    p = Path(path) if path else bundled_path(model_id)
    if not path and not p.is_file():
        return None
    v = Verifier.load(p)
    if v.dim != dim or v.model_id != model_id:
        raise VerifierError(f"{p}: trained for {v.model_id} ({v.dim} dims), the embedder "
                            f"runs {model_id} ({dim} dims)")
    return v


def train(x: np.ndarray, y: np.ndarray, l2: float = 3e-3, iters: int = 300,
          lr: float = 0.05, sample_weight: np.ndarray | None = None,
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Fit a logistic regression on standardised features by full-batch Adam.

    ``x`` (n, F), ``y`` (n,) 0/1, ``l2`` ridge penalty on the weights (not the bias),
    ``sample_weight`` (n,) or None. Returns ``(mean, scale, w, b)``. Deterministic. About
    1 s for 15 000 pairs of 1 042 features on one core."""
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.float32)
    if x.ndim != 2 or len(x) != len(y) or len(x) == 0:
        raise ValueError("x must be (n, F) and y (n,), n > 0")
    sw = np.ones(len(y), np.float32) if sample_weight is None \
        else np.asarray(sample_weight, np.float32)
    sw = sw / sw.mean()
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-6] = 1.0
    z = (x - mean) / scale
    n, f = z.shape
    w = np.zeros(f, np.float32)
    b = 0.0
    mw, vw = np.zeros(f, np.float32), np.zeros(f, np.float32)
    mb = vb = 0.0
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t in range(1, iters + 1):
        p = _sigmoid(z @ w + b).astype(np.float32)
        err = (p - y) * sw
        gw = z.T @ err / n + l2 * w
        gb = float(err.mean())
        mw = b1 * mw + (1 - b1) * gw
        vw = b2 * vw + (1 - b2) * gw * gw
        mb = b1 * mb + (1 - b1) * gb
        vb = b2 * vb + (1 - b2) * gb * gb
        w -= lr * (mw / (1 - b1 ** t)) / (np.sqrt(vw / (1 - b2 ** t)) + eps)
        b -= lr * (mb / (1 - b1 ** t)) / (math.sqrt(vb / (1 - b2 ** t)) + eps)
    return mean, scale, w, float(b)


def fit(x: np.ndarray, y: np.ndarray, dim: int, model_id: str, min_score: float = 0.5,
        floor: float = 0.5, **kw) -> Verifier:
    """:func:`train` and wrap the result as a :class:`Verifier`."""
    mean, scale, w, b = train(x, y, **kw)
    return Verifier(dim, model_id, mean, scale, w, b, min_score, floor)


def cross_val_scores(x: np.ndarray, y: np.ndarray, folds: np.ndarray, floor: float = 0.5,
                     extra: tuple[np.ndarray, np.ndarray] | None = None, **kw) -> np.ndarray:
    """Out-of-fold probabilities (n,): for each fold, a verifier trained (:func:`train`) on
    the other folds' pairs with cosine >= ``floor`` (plus ``extra`` = (features, labels),
    e.g. :func:`self_pairs`) scores the fold's pairs. ``folds`` (n,) holds fold numbers
    (``calibration.fold_ids``). Raises ``ValueError`` when a training split is empty."""
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y)
    cos = cosine_of(x)
    out = np.zeros(len(y), dtype=np.float64)
    for k in np.unique(folds):
        tr = (folds != k) & (cos >= floor)
        if not tr.any() or len(np.unique(y[tr])) < 2:
            raise ValueError(f"fold {k}: the training split needs pairs of both labels")
        xs, ys = x[tr], y[tr]
        if extra is not None:
            xs, ys = np.vstack([xs, extra[0]]), np.concatenate([ys, extra[1]])
        mean, scale, w, b = train(xs, ys, **kw)
        te = folds == k
        out[te] = _sigmoid(((x[te] - mean) / scale) @ w + b)
    return out


def cosine_of(x: np.ndarray) -> np.ndarray:
    """The cosine column of a feature matrix (n, F)."""
    x = np.asarray(x)
    return x[:, x.shape[1] - len(SCALAR_FEATURES)]


def self_pairs(texts: Sequence[str], vecs: np.ndarray, n: int = 800,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Training augmentation: ``(features, labels)`` of up to ``n`` texts (sampled with
    ``seed``) paired with themselves, label 1. Labelled sets rarely hold identical
    questions; without these the model learns nothing about the top of the cosine range
    and ranks near-copies below looser paraphrases. ``vecs`` (len(texts), dim)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(texts), min(n, len(texts)), replace=False) if len(texts) else []
    t = [texts[i] for i in idx]
    v = np.asarray(vecs, dtype=np.float32)[list(idx)]
    return features(t, t, v, v), np.ones(len(t), dtype=np.int64)
