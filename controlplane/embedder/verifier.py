"""Learned verifier: between retrieval (cosine >= a floor) and serving, a small model in
numpy decides whether the cached question and the new one mean the same.

Features of a pair (query ``q`` with unit vector ``u``, candidate ``c`` with ``v``),
:data:`FEATURE_VERSION` 2, ``2 * dim + len(SCALAR_FEATURES)`` values (:func:`n_features`):

- ``|u - v|`` and ``u * v`` (element-wise; ``dim`` each): which directions agree;
- scalars of version 1 (:data:`SCALAR_FEATURES_V1`): cosine and its square, the precision
  guard's signals (``guard.py``: numbers differ, negation in one text only, antonym
  conflict, swapped sides, key-term and key-character substitution, guard passes), lengths
  (log characters of each, min/max ratio), overlap (Jaccard of characters, of character
  bigrams and of key terms; key terms only in one text, counted), share of CJK characters;
- content-word scalars, added in version 2 (:data:`CONTENT_FEATURES`, over
  :func:`content_words`, the words ``calibration.duplicate_key`` keeps): the sequences are
  equal (lexical duplicates), Jaccard of the word sets, longest common subsequence, share
  of discordant word pairs (word order), same words reordered, wh-words differ, words only
  in one text.

Two model kinds over the standardised features ``z = (x - mean) / scale``:

- ``logistic``: ``sigmoid(w . z + b)`` (:func:`train`, :func:`fit`);
- ``mlp``: the mean probability of a few one-hidden-layer networks
  ``sigmoid(relu(z @ w1 + b1) @ w2 + b2)`` trained from different initial weights
  (:func:`train_mlp`, :func:`fit_mlp`).

Either gives a probability 0-1; texts equal up to case, spaces, punctuation and the
Chinese synonyms of ``guard.ZH_SYNONYMS`` score 1 (:func:`same_words`).
About 0.3-0.4 ms per pair on an idle core (the guard's text checks dominate; their
per-text results are cached; the networks add a few microseconds).

The model file is JSON (:meth:`Verifier.save`), file version 2: ``{"version",
"feature_version", "kind", "dim", "model_id", "mean", "scale", "min_score", "floor",
"trained_on", "cv", "fingerprint", "language_min_score", "language_min_cosine"}``
plus ``"w", "b"`` (logistic) or ``"members"``
(mlp: per network ``"hidden"``, ``"w1_f16"`` = the (F, hidden) input weights as
little-endian float16, row-major, base64, ``"b1"``, ``"w2"``, ``"b2"``). Version 1 files (logistic, feature version
1, no ``kind``) still load and are scored with the version 1 features. ``min_score`` is
the default operating point (probability a hit needs), ``floor`` the cosine a candidate
needs to be considered at all. The package ships one for ``use-multilingual-v3``
(``data/verifier-use-multilingual-v3.json``, trained by ``bench/cache_quality/verifier.py
--write-verifier`` on the fit part of the cache-eval dev sets, ``split.split_sets``);
``infergate cache calibrate --train-verifier`` fits a logistic one on an operator's pairs
for one domain. ``"fingerprint"`` (optional) holds the hashes of the normalised texts it
was trained on (``split.fingerprint``), so calibration can refuse to grade it on them.

Errors: :class:`VerifierError` for a file that cannot be read or does not fit the model.
"""

from __future__ import annotations

import base64
import difflib
import functools
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from controlplane.embedder import guard
from controlplane.embedder.calibration import WH_WORDS, duplicate_key
from controlplane.errors import InfergateError

FEATURE_VERSION = 2
FEATURE_VERSIONS = (1, 2)
FILE_VERSION = 2
FILE_VERSIONS = (1, 2)
DATA_DIR = Path(__file__).resolve().parent / "data"

SCALAR_FEATURES_V1 = (
    "cos", "cos2", "numbers_differ", "negation_differs", "antonym", "swapped", "key_terms",
    "key_chars", "guard_pass", "log_len_q", "log_len_c", "len_ratio", "char_jaccard",
    "bigram_jaccard", "term_jaccard", "terms_only_q", "terms_only_c", "cjk_share",
)
CONTENT_FEATURES = (
    "seq_equal", "content_jaccard", "content_lcs", "order_discordant", "same_bag_reordered",
    "wh_differs", "wh_first_differs", "content_only_q", "content_only_c",
)
SCALAR_FEATURES = SCALAR_FEATURES_V1 + CONTENT_FEATURES
"""Scalar features of :data:`FEATURE_VERSION` 2; version 1 has the first 18."""


def scalar_names(feature_version: int = FEATURE_VERSION) -> tuple[str, ...]:
    """The scalar feature names of a feature version (1 or 2)."""
    return SCALAR_FEATURES_V1 if feature_version == 1 else SCALAR_FEATURES


def n_features(dim: int, feature_version: int = FEATURE_VERSION) -> int:
    """Width of a feature matrix: ``2 * dim`` plus the scalars of the version."""
    return 2 * dim + len(scalar_names(feature_version))

_CJK_RE = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_SPACE_RE = re.compile(r"\s+")


class VerifierError(InfergateError, ValueError):
    """A verifier file cannot be read, or does not fit the embedding model."""


_PLAIN_RE = re.compile(r"[\W_]+")


def _plain(text: str) -> str:
    """Lowercase text without spaces, punctuation and symbols."""
    return _PLAIN_RE.sub("", text[:guard.MAX_GUARD_CHARS].lower())


def same_words(query: str, candidate: str) -> bool:
    """Whether the two texts are equal up to case, spaces, punctuation and the Chinese
    synonyms of ``guard.ZH_SYNONYMS`` ("怎么重置密码？" / "如何重设密码"): the same question,
    which the verifier scores 1 without working out its features. On the cache-eval dev
    sets every such pair outside the plain duplicates is labelled a match (35 of 35, fit and judge parts)."""
    a = _canonical_plain(query[:guard.MAX_GUARD_CHARS])
    return a != "" and a == _canonical_plain(candidate[:guard.MAX_GUARD_CHARS])


@functools.lru_cache(maxsize=8192)
def _canonical_plain(text: str) -> str:
    """:func:`_plain` of ``guard.zh_canonical(text)``; cached per text (the entries'
    texts recur in every lookup of their namespace)."""
    return _plain(guard.zh_canonical(text))


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


@functools.lru_cache(maxsize=8192)
def content_words(text: str) -> tuple[str, ...]:
    """The content words of ``text`` (``calibration.duplicate_key``: lower case, no
    articles, auxiliaries, first- and second-person pronouns or light words, stemmed), in
    order, with CJK runs split into characters; cached per text."""
    out: list[str] = []
    for w in duplicate_key(text[:guard.MAX_GUARD_CHARS]).split():
        out.extend(w if _CJK_RE.search(w) else (w,))
    return tuple(out)


def content_features(query: str, candidate: str) -> list[float]:
    """The :data:`CONTENT_FEATURES` of one pair, over :func:`content_words`: equal
    sequences (lexical duplicates), Jaccard of the word sets, longest common subsequence
    over the longer length, share of discordant pairs among the words both hold once
    (word order: "A better than B" / "B better than A"), same words in another order,
    wh-words differ (as sets, and the first one), words only in one text (counted, at most
    5)."""
    a, b = content_words(query), content_words(candidate)
    sa, sb = set(a), set(b)
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    lcs = sum(m.size for m in sm.get_matching_blocks()) / max(1, len(a), len(b))
    pos_b = {w: i for i, w in enumerate(b)}
    ca, cb = Counter(a), Counter(b)
    once = [pos_b[w] for w in a if ca[w] == 1 and cb.get(w) == 1]
    k = len(once)
    disc = sum(once[i] > once[j] for i in range(k) for j in range(i + 1, k))
    wa, wb = [w for w in a if w in WH_WORDS], [w for w in b if w in WH_WORDS]
    return [float(a == b), _jaccard(sa, sb), lcs, disc / (k * (k - 1) / 2) if k > 1 else 0.0,
            float(a != b and sorted(a) == sorted(b)), float(set(wa) != set(wb)),
            float(wa[:1] != wb[:1]), float(min(len(sa - sb), 5)), float(min(len(sb - sa), 5))]


def features(queries: Sequence[str], candidates: Sequence[str], u: np.ndarray,
             v: np.ndarray, feature_version: int = FEATURE_VERSION) -> np.ndarray:
    """(n, :func:`n_features`) float32 features of n pairs; ``u``/``v`` are the (n, dim)
    L2-normalised vectors of ``queries``/``candidates``. ``feature_version`` 1 leaves out
    the :data:`CONTENT_FEATURES` (files trained before they existed)."""
    u = np.asarray(u, dtype=np.float32).reshape(len(queries), -1)
    v = np.asarray(v, dtype=np.float32).reshape(len(candidates), -1)
    cos = np.einsum("ij,ij->i", u, v)
    rows = []
    for q, c, s in zip(queries, candidates, cos):
        r = scalar_features(q, c, float(s))
        if feature_version != 1:
            r += content_features(q[:guard.MAX_GUARD_CHARS], c[:guard.MAX_GUARD_CHARS])
        rows.append(r)
    scal = np.array(rows, dtype=np.float32).reshape(len(queries), -1)
    return np.hstack([np.abs(u - v), u * v, scal])


def language_of(text: str) -> str:
    """``zh`` when ``text`` (its first 4000 characters) holds a CJK character, else
    ``other``: the language key of :attr:`Verifier.language_min_score`."""
    return "zh" if _CJK_RE.search(text[:guard.MAX_GUARD_CHARS]) else "other"


def _logit(p: float) -> float:
    p = min(max(p, 1e-9), 1 - 1e-9)
    return math.log(p / (1 - p))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0)))


@dataclass
class Member:
    """One network of an MLP verifier: ``sigmoid(relu(z @ w1 + b1) @ w2 + b2)`` on the
    standardised features ``z``; ``w1`` (F, hidden), ``b1`` (hidden,), ``w2`` (hidden,)."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: float

    def prob(self, z: np.ndarray) -> np.ndarray:
        return _sigmoid(np.maximum(z @ self.w1 + self.b1, 0.0) @ self.w2 + self.b2)


def _f16_b64(a: np.ndarray) -> str:
    return base64.b64encode(np.asarray(a, dtype="<f2").tobytes()).decode("ascii")


def _from_f16_b64(text: str, shape: tuple[int, ...]) -> np.ndarray:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if a.size != math.prod(shape):
        raise VerifierError(f"verifier file: expected {math.prod(shape)} packed weights, "
                            f"found {a.size}")
    return a.reshape(shape)


@dataclass
class Verifier:
    """A trained model over :func:`features` (see the module docstring): a logistic
    regression (``w``, ``b``) when ``members`` is empty, else the mean probability of the
    one-hidden-layer networks in ``members``."""

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
    feature_version: int = FEATURE_VERSION
    members: list[Member] = field(default_factory=list)
    fingerprint: str = ""
    """Hashes of the normalised texts it was trained on (``split.fingerprint``; empty:
    unknown)."""
    language_min_score: dict[str, float] = field(default_factory=dict)
    """Per query language (:func:`language_of`: ``zh`` or ``other``), the model's
    probability that serves at :attr:`min_score`: :meth:`score` rescales the probability
    of a query of that language (a shift of its logit) so that ``language_min_score[L]``
    becomes :attr:`min_score`. Empty: no rescaling. One threshold (the default or a
    domain's calibrated one) then serves both languages at their own operating points."""

    language_min_cosine: dict[str, float] = field(default_factory=dict)
    """Per query language, the plain-cosine rule the verifier is never worse than: a pair
    whose cosine reaches it and that passes every check of the guard (the ``guard_pass``
    feature) scores at least :attr:`min_score`, whatever the model says (a floor rising
    with the cosine: ``sigmoid(logit(min_score) + 200 (cos - point))``). Empty: none."""

    def prior(self, cos: np.ndarray, guard_pass: np.ndarray,
              languages: Sequence[str]) -> np.ndarray:
        """The floor of :attr:`language_min_cosine` per pair (0 where none applies)."""
        cos = np.asarray(cos, dtype=np.float64)
        point = np.array([self.language_min_cosine.get(lang, 2.0) for lang in languages])
        z = _logit(self.min_score) + 200.0 * (cos - point)
        out = 1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0)))
        out = np.where(cos >= point, np.maximum(out, self.min_score), out)
        return np.where(np.asarray(guard_pass, dtype=bool) & (point <= 1.0), out, 0.0)

    def rescale(self, p: np.ndarray, languages: Sequence[str]) -> np.ndarray:
        """Probabilities ``p`` (n,) of queries of ``languages`` (n,) after the shift of
        :attr:`language_min_score` (monotone per language; 0 and 1 stay put)."""
        p = np.asarray(p, dtype=np.float64)
        if not self.language_min_score:
            return p
        point = np.array([self.language_min_score.get(lang, self.min_score)
                          for lang in languages], dtype=np.float64)
        shift = _logit(self.min_score) - np.log(point / (1 - point))
        q = np.clip(p, 1e-9, 1 - 1e-9)
        out = 1.0 / (1.0 + np.exp(-(np.log(q / (1 - q)) + shift)))
        # exactly: p >= the language's point <=> the rescaled value >= min_score
        out = np.where(p >= point, np.maximum(out, self.min_score),
                       np.minimum(out, np.nextafter(self.min_score, 0.0)))
        return np.where((p <= 0.0) | (p >= 1.0), p, out)

    def training_hashes(self) -> np.ndarray:
        """The sorted uint64 hashes of :attr:`fingerprint` (empty when unknown). Raises
        :class:`VerifierError` for a malformed fingerprint."""
        from controlplane.embedder import split

        if not self.fingerprint:
            return np.zeros(0, dtype=np.uint64)
        try:
            return split.parse_fingerprint(self.fingerprint)
        except ValueError as exc:
            raise VerifierError(f"verifier file: {exc}") from None

    @property
    def kind(self) -> str:
        return "mlp" if self.members else "logistic"

    def score_features(self, x: np.ndarray) -> np.ndarray:
        """Probabilities (n,) for a feature matrix (n, F) of :attr:`feature_version`."""
        z = (np.asarray(x, dtype=np.float32) - self.mean) / self.scale
        if self.members:
            return np.mean([m.prob(z) for m in self.members], axis=0)
        return _sigmoid(z @ self.w + self.b)

    def score(self, queries: Sequence[str], candidates: Sequence[str], u: np.ndarray,
              v: np.ndarray) -> np.ndarray:
        """Probability (n,) that each query means the same as its candidate."""
        n = len(queries)
        out = np.ones(n, dtype=np.float64)
        # the same words up to case, spacing, punctuation and Chinese synonyms: the same
        # question, scored 1 without working out its features
        rest = [i for i, (q, c) in enumerate(zip(queries, candidates))
                if not same_words(q, c)]
        if rest:
            u = np.asarray(u, dtype=np.float32).reshape(n, -1)
            v = np.asarray(v, dtype=np.float32).reshape(n, -1)
            x = features([queries[i] for i in rest], [candidates[i] for i in rest], u[rest],
                         v[rest], self.feature_version)
            langs = [language_of(queries[i]) for i in rest]
            p = self.rescale(self.score_features(x), langs)
            if self.language_min_cosine:
                fv = self.feature_version
                p = np.maximum(p, self.prior(cosine_of(x, fv),
                                             column(x, "guard_pass", fv) > 0.5, langs))
            out[rest] = p
        return out

    def to_dict(self) -> dict:
        d = {"version": FILE_VERSION, "feature_version": self.feature_version,
             "kind": self.kind, "dim": self.dim, "model_id": self.model_id,
             "min_score": self.min_score, "floor": self.floor,
             "mean": [round(float(x), 6) for x in self.mean],
             "scale": [round(float(x), 6) for x in self.scale]}
        if self.members:
            d["members"] = [{"hidden": int(m.w1.shape[1]), "w1_f16": _f16_b64(m.w1),
                             "b1": [round(float(x), 6) for x in m.b1],
                             "w2": [round(float(x), 6) for x in m.w2],
                             "b2": round(float(m.b2), 6)} for m in self.members]
        else:
            d["w"] = [round(float(x), 6) for x in self.w]
            d["b"] = float(self.b)
        d["trained_on"], d["cv"] = self.trained_on, self.cv
        if self.fingerprint:
            d["fingerprint"] = self.fingerprint
        if self.language_min_score:
            d["language_min_score"] = dict(self.language_min_score)
        if self.language_min_cosine:
            d["language_min_cosine"] = dict(self.language_min_cosine)
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False) + "\n",
                              encoding="utf-8")

    @classmethod
    def from_dict(cls, d: dict) -> "Verifier":
        """Reads file versions 1 (logistic regression, feature version 1) and 2. Raises
        :class:`VerifierError` for an unknown version or inconsistent sizes."""
        try:
            version, fv = d.get("version"), d.get("feature_version")
            if version not in FILE_VERSIONS or fv not in FEATURE_VERSIONS \
                    or (version == 1 and fv != 1):
                raise VerifierError(f"verifier file version {version}/{fv}, expected one of "
                                    f"{FILE_VERSIONS} with feature version "
                                    f"{FEATURE_VERSIONS}")
            kind = d.get("kind", "logistic")
            if kind not in ("logistic", "mlp") or (version == 1 and kind != "logistic"):
                raise VerifierError(f"verifier file: unknown kind {kind!r}")
            dim = int(d["dim"])
            n = n_features(dim, fv)
            mean = np.asarray(d["mean"], dtype=np.float32)
            scale = np.asarray(d["scale"], dtype=np.float32)
            if not (mean.shape == scale.shape == (n,)) or (scale <= 0).any():
                raise VerifierError(f"verifier file: expected {n} means and positive scales")
            members: list[Member] = []
            if kind == "mlp":
                for m in d["members"]:
                    h = int(m["hidden"])
                    b1 = np.asarray(m["b1"], dtype=np.float32)
                    w2 = np.asarray(m["w2"], dtype=np.float32)
                    if h <= 0 or b1.shape != (h,) or w2.shape != (h,):
                        raise VerifierError(f"verifier file: expected {h} hidden biases and "
                                            "output weights")
                    members.append(Member(_from_f16_b64(m["w1_f16"], (n, h)), b1, w2,
                                          float(m["b2"])))
                if not members:
                    raise VerifierError("verifier file: an mlp needs at least one member")
                w, b = np.zeros(0, np.float32), 0.0
            else:
                w, b = np.asarray(d["w"], dtype=np.float32), float(d["b"])
                if w.shape != (n,):
                    raise VerifierError(f"verifier file: expected {n} weights, means and "
                                        "positive scales")
            lang = {str(k): float(x) for k, x in (d.get("language_min_score") or {}).items()}
            lcos = {str(k): float(x)
                    for k, x in (d.get("language_min_cosine") or {}).items()}
            if any(not 0.0 < x < 1.0 for x in lang.values()) \
                    or any(not 0.0 < x <= 1.0 for x in lcos.values()) \
                    or not 0.0 < float(d["min_score"]) < 1.0 and (lang or lcos):
                raise VerifierError("verifier file: language_min_score and min_score must "
                                    "be in (0, 1), language_min_cosine in (0, 1]")
            return cls(dim, str(d["model_id"]), mean, scale, w, b,
                       float(d["min_score"]), float(d["floor"]),
                       dict(d.get("trained_on") or {}), dict(d.get("cv") or {}), fv, members,
                       str(d.get("fingerprint") or ""), lang, lcos)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
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


def _version_of(x: np.ndarray, dim: int) -> int:
    for fv in FEATURE_VERSIONS:
        if x.shape[1] == n_features(dim, fv):
            return fv
    raise ValueError(f"x has {x.shape[1]} columns: not a feature matrix for {dim} dims")


def fit(x: np.ndarray, y: np.ndarray, dim: int, model_id: str, min_score: float = 0.5,
        floor: float = 0.5, **kw) -> Verifier:
    """:func:`train` (a logistic regression) and wrap the result as a :class:`Verifier`;
    the feature version follows the width of ``x``."""
    x = np.asarray(x, dtype=np.float32)
    fv = _version_of(x, dim)
    mean, scale, w, b = train(x, y, **kw)
    return Verifier(dim, model_id, mean, scale, w, b, min_score, floor, feature_version=fv)


def train_mlp(x: np.ndarray, y: np.ndarray, hidden: int = 32, l2: float = 3e-2,
              iters: int = 300, lr: float = 0.01, seeds: Sequence[int] = (0, 1, 2),
              ) -> tuple[np.ndarray, np.ndarray, list[Member]]:
    """Fit one-hidden-layer networks (ReLU, sigmoid output, cross-entropy) on standardised
    features by full-batch Adam, one per seed (the seed draws the initial weights; the
    verifier averages their probabilities, which steadies the top of the score range).

    ``x`` (n, F), ``y`` (n,) 0/1, ``l2`` ridge penalty on the weights (not the biases).
    Returns ``(mean, scale, members)``. Deterministic. About 15 s per member for 20 000
    pairs of 1 051 features on one core."""
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.float32)
    if x.ndim != 2 or len(x) != len(y) or len(x) == 0:
        raise ValueError("x must be (n, F) and y (n,), n > 0")
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-6] = 1.0
    z = (x - mean) / scale
    n, f = z.shape
    b1_, b2_, eps = 0.9, 0.999, 1e-8
    members = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        params = [(rng.standard_normal((f, hidden)) * math.sqrt(2.0 / f)).astype(np.float32),
                  np.zeros(hidden, np.float32),
                  (rng.standard_normal(hidden) * math.sqrt(1.0 / hidden)).astype(np.float32),
                  np.zeros(1, np.float32)]
        m1 = [np.zeros_like(p) for p in params]
        m2 = [np.zeros_like(p) for p in params]
        for t in range(1, iters + 1):
            w1, b1, w2, b2 = params
            a = z @ w1 + b1
            h = np.maximum(a, 0.0)
            err = ((_sigmoid(h @ w2 + b2[0]) - y) / n).astype(np.float32)
            da = np.outer(err, w2) * (a > 0)
            grads = (z.T @ da + l2 * w1, da.sum(axis=0), h.T @ err + l2 * w2,
                     np.array([err.sum()], np.float32))
            for i, g in enumerate(grads):
                m1[i] = b1_ * m1[i] + (1 - b1_) * g
                m2[i] = b2_ * m2[i] + (1 - b2_) * g * g
                params[i] -= lr * (m1[i] / (1 - b1_ ** t)) / (
                    np.sqrt(m2[i] / (1 - b2_ ** t)) + eps)
        members.append(Member(params[0], params[1], params[2], float(params[3][0])))
    return mean, scale, members


def fit_mlp(x: np.ndarray, y: np.ndarray, dim: int, model_id: str, min_score: float = 0.5,
            floor: float = 0.5, **kw) -> Verifier:
    """:func:`train_mlp` and wrap the result as a :class:`Verifier`."""
    x = np.asarray(x, dtype=np.float32)
    fv = _version_of(x, dim)
    mean, scale, members = train_mlp(x, y, **kw)
    return Verifier(dim, model_id, mean, scale, np.zeros(0, np.float32), 0.0, min_score,
                    floor, feature_version=fv, members=members)


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


def column(x: np.ndarray, name: str, feature_version: int = FEATURE_VERSION) -> np.ndarray:
    """The scalar feature ``name`` (one of :func:`scalar_names`) of a feature matrix (n, F)
    of ``feature_version``."""
    x = np.asarray(x)
    names = scalar_names(feature_version)
    return x[:, x.shape[1] - len(names) + names.index(name)]


def cosine_of(x: np.ndarray, feature_version: int = FEATURE_VERSION) -> np.ndarray:
    """The cosine column of a feature matrix (n, F)."""
    return column(x, "cos", feature_version)


def self_pairs(texts: Sequence[str], vecs: np.ndarray, n: int = 800,
               seed: int = 0, feature_version: int = FEATURE_VERSION,
               ) -> tuple[np.ndarray, np.ndarray]:
    """Training augmentation: ``(features, labels)`` of up to ``n`` texts (sampled with
    ``seed``) paired with themselves, label 1. Labelled sets rarely hold identical
    questions; without these the model learns nothing about the top of the cosine range
    and ranks near-copies below looser paraphrases. ``vecs`` (len(texts), dim)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(texts), min(n, len(texts)), replace=False) if len(texts) else []
    t = [texts[i] for i in idx]
    v = np.asarray(vecs, dtype=np.float32)[list(idx)]
    return features(t, t, v, v, feature_version), np.ones(len(t), dtype=np.int64)
