"""Threshold calibration from labelled pairs: confidence bounds, threshold sweep, choice.

A semantic cache serves a stored answer when a score (cosine similarity, or the learned
verifier's probability) is at or above a threshold. On labelled pairs (``label`` 1 = same
meaning, 0 = different) the *hit rate* at a threshold is the share of matching pairs
served and the *wrong-hit rate* the share of non-matching pairs served. A few hundred
negatives give a noisy rate, so the threshold is chosen on its **95 % upper confidence
bound** (one-sided): the lowest threshold whose bound is at or under the target.

Bounds (``k`` wrong hits out of ``n`` negatives, result a rate 0-1):

- :func:`wilson_upper`: Wilson score interval, one-sided, ``z`` = 1.6449 for 95 %.
- :func:`clopper_pearson_upper`: the exact binomial bound (the ``p`` at which
  ``P(X <= k) = 1 - confidence``), found by bisection; more conservative than Wilson.

Pair files (:func:`load_pairs`): TSV ``text1<TAB>text2<TAB>label`` (a header line
``text1 text2 label`` is optional), JSONL with ``text1``/``text2``/``label``, or JSONL of
paraphrases only (``{"origin", "similar"}``, the qqp shape: every pair label 1). Sets
without negatives get mined ones (:func:`mine_negatives`): per query, the closest cached
question of another group, where groups join paired texts and lexical duplicates
(:func:`duplicate_key`: equal sequences of content words, a test that uses no embedding
model, so the measure does not grade the model with its own judgement). Texts that
differ in a number, a negation, a wh-word, a content word or the order of words stay
apart, so such a neighbour is still mined as a negative.

Pure logic, no I/O besides :func:`load_pairs`; numpy only.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from controlplane.embedder.bounds import Z95, wilson_upper  # noqa: F401 (re-exported)
from controlplane.errors import InfergateError


class PairsError(InfergateError, ValueError):
    """The pair file cannot be read or holds no usable pair."""


# ---------------------------------------------------------------- bounds

def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    lg_n = math.lgamma(n + 1)
    terms = [lg_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k + 1)]
    m = max(terms)
    return min(1.0, math.exp(m) * sum(math.exp(t - m) for t in terms))


def clopper_pearson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """Exact (Clopper-Pearson) one-sided upper bound for ``k`` out of ``n`` (0-1).

    ``n == 0`` or ``k == n`` returns 1.0. Raises ``ValueError`` for bad ``k``/``n`` or a
    ``confidence`` outside (0, 1)."""
    if k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    if n == 0 or k == n:
        return 1.0
    alpha = 1.0 - confidence
    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _binom_cdf(k, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


BOUNDS = {"wilson": wilson_upper, "clopper-pearson": clopper_pearson_upper}


# ---------------------------------------------------------------- sweep and choice

@dataclass(frozen=True)
class SweepRow:
    """One threshold: ``hits`` of ``positives`` served, ``wrong`` of ``negatives`` served;
    rates 0-1 (None without pairs of that label); ``wrong_upper`` the 95 % bound."""

    threshold: float
    hits: int
    positives: int
    wrong: int
    negatives: int
    hit_rate: float | None
    wrong_rate: float | None
    wrong_upper: float

    def to_dict(self) -> dict:
        return asdict(self)


def sweep(scores: Sequence[float] | np.ndarray, labels: Sequence[int] | np.ndarray,
          thresholds: Sequence[float], allowed: Sequence[bool] | np.ndarray | None = None,
          bound: str = "wilson") -> list[SweepRow]:
    """Hit and wrong-hit counts per threshold: a pair is served when ``score >=
    threshold`` and ``allowed`` (e.g. the precision guard passed; None = all allowed).

    ``scores``, ``labels`` (1/0) and ``allowed``: one value per pair. Raises
    ``ValueError`` on length mismatch or an unknown ``bound``."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    ok = np.ones(len(s), bool) if allowed is None else np.asarray(allowed, dtype=bool)
    if not (len(s) == len(y) == len(ok)):
        raise ValueError("scores, labels and allowed must have the same length")
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {sorted(BOUNDS)}")
    ub = BOUNDS[bound]
    pos, neg = y == 1, y == 0
    npos, nneg = int(pos.sum()), int(neg.sum())
    rows = []
    for t in thresholds:
        served = (s >= t) & ok
        h, w = int((served & pos).sum()), int((served & neg).sum())
        rows.append(SweepRow(float(t), h, npos, w, nneg,
                             h / npos if npos else None, w / nneg if nneg else None,
                             ub(w, nneg)))
    return rows


def choose(rows: Sequence[SweepRow], max_wrong: float) -> SweepRow | None:
    """The row of the lowest threshold whose ``wrong_upper`` <= ``max_wrong``, or None
    when no threshold is safe enough (too few negatives, or the score cannot separate)."""
    for row in sorted(rows, key=lambda r: r.threshold):
        if row.wrong_upper <= max_wrong:
            return row
    return None


def grid(lo: float, hi: float, step: float) -> list[float]:
    """Thresholds ``lo, lo+step, ..., hi`` rounded to 4 digits."""
    n = int(round((hi - lo) / step))
    return [round(lo + i * step, 4) for i in range(n + 1)]


# ---------------------------------------------------------------- pair files

@dataclass
class Pairs:
    """Labelled pairs: ``text1`` (the cached question), ``text2`` (the new one), ``label``
    (1 same meaning, 0 different). ``mined`` marks negatives made by :func:`mine_negatives`."""

    text1: list[str]
    text2: list[str]
    label: list[int]
    mined: list[bool]
    skipped: int = 0
    """Lines of the file that held no usable pair (a header, a label other than 0 or 1,
    fewer than three fields, an empty text)."""

    def __len__(self) -> int:
        return len(self.label)


def load_pairs(path: str | Path) -> Pairs:
    """Read a TSV or JSONL pair file (see the module docstring).

    Raises :class:`PairsError` when the file is missing, unreadable or has no valid pair."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PairsError(f"{p}: cannot read: {exc}") from None
    t1: list[str] = []
    t2: list[str] = []
    lab: list[int] = []
    skipped = 0
    first = text.lstrip()[:1]
    if first in ("{", "["):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                raise PairsError(f"{p}:{n}: not a JSON object") from None
            if not isinstance(d, dict):
                raise PairsError(f"{p}:{n}: not a JSON object")
            a, b = d.get("text1", d.get("origin")), d.get("text2", d.get("similar"))
            label = d.get("label", 1 if "origin" in d else None)
            if isinstance(label, str) and label in ("0", "1"):
                label = int(label)
            if isinstance(a, str) and isinstance(b, str) and a.strip() and b.strip() \
                    and label in (0, 1) and not isinstance(label, bool):
                t1.append(a)
                t2.append(b)
                lab.append(int(label))
            else:
                skipped += 1
    else:
        # fields split on tabs as they are (no quoting): no field-size limit
        for line in text.splitlines():
            if not line.strip():
                continue
            row = line.split("\t")
            if len(row) < 3:
                skipped += 1
                continue
            a, b, label = row[0], row[1], row[2].strip()
            if label not in ("0", "1") or not a.strip() or not b.strip():
                skipped += 1  # the header line, or a malformed row
                continue
            t1.append(a)
            t2.append(b)
            lab.append(int(label))
    if not lab:
        raise PairsError(f"{p}: no valid pair (TSV text1<TAB>text2<TAB>label, or JSONL with "
                         "text1/text2/label or origin/similar)")
    return Pairs(t1, t2, lab, [False] * len(lab), skipped)


def normalise(t: str) -> str:
    """Lower case, runs of non-word characters to one space: the form in which
    :func:`groups` compares texts."""
    return re.sub(r"[\W_]+", " ", t.lower()).strip()


def same_text(a: str, b: str) -> bool:
    """True when the exact cache cannot tell ``a`` from ``b``: equal after Unicode NFC, the
    only normalisation of the exact key (:mod:`controlplane.cache.key`)."""
    return a == b or unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b)


def drop_same_text(pairs: Pairs) -> tuple[Pairs, int]:
    """``pairs`` without the pairs whose two texts are the same text (:func:`same_text`),
    and how many there were. The exact cache answers such a repeat whatever the semantic
    settings, so it says nothing about a threshold; a same-text pair labelled 0 (label
    noise, as in translated sets where two English sentences became one Chinese one)
    would count a wrong hit no threshold avoids, and one labelled 1 a hit no threshold
    loses."""
    keep = [i for i, (a, b) in enumerate(zip(pairs.text1, pairs.text2))
            if not same_text(a, b)]
    if len(keep) == len(pairs):
        return pairs, 0
    out = Pairs([pairs.text1[i] for i in keep], [pairs.text2[i] for i in keep],
                [pairs.label[i] for i in keep], [pairs.mined[i] for i in keep],
                pairs.skipped)
    return out, len(pairs) - len(keep)


# ---------------------------------------------------------------- duplicate key

# Contractions, expanded before words are split ("what's" -> "what is", "n't" -> " not").
# "'s" is "is", "has" or a possessive: all three are dropped below, so it goes at once.
_CONTRACTIONS = (
    (re.compile(r"\b(can)'?t\b"), r"\1 not"), (re.compile(r"\bwon'?t\b"), "will not"),
    (re.compile(r"\bshan't\b"), "shall not"), (re.compile(r"\bain't\b"), "is not"),
    (re.compile(r"\b(do|does|did|is|are|was|were|has|have|had|would|should|could|must|need)"
                r"n'?t\b"), r"\1 not"),
    (re.compile(r"n't\b"), " not"), (re.compile(r"\b(what|who|where|how|when|why|that|there)s\b"),
                                      r"\1 is"),
    (re.compile(r"\blet's\b"), "let us"), (re.compile(r"'re\b"), " are"),
    (re.compile(r"'m\b"), " am"), (re.compile(r"'ve\b"), " have"), (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'d\b"), " would"), (re.compile(r"'s\b"), " "),
)
_WORD_RE = re.compile(r"[^\W_]+")
# Dropped: articles, forms of be / do / have, future and conditional will / would / shall,
# first- and second-person pronouns (the asker and the generic "you": "how do I" = "how do
# you"), and light words that do not change a question ("that", "some", "really", ...).
# Kept: wh-words, negations, numbers, prepositions, third-person pronouns (who does what
# to whom), the modals can / may / should / must, and every other word, in order.
DUP_DROPPED = frozenset("""
    a an the
    am is are was were be been being do does did have has had will would shall
    i me my mine myself we us our ours ourselves you your yours yourself yourselves
    that some any really actually exactly just ever also very so please
""".split())
# Spellings of one word: "which" asks what "what" asks; "could" / "might" are the
# politer "can" / "may".
DUP_SAME = {"which": "what", "whom": "who", "could": "can", "might": "may", "cannot": "can not"}
WH_WORDS = frozenset({"what", "who", "whose", "why", "how", "when", "where"})
# Right after "how" a modal, or "to", asks for the same method ("how can I", "how should
# I", "how to", "how do I"); right after another wh-word "can" asks what the plain
# question asks ("where can I" / "where do I"); elsewhere they are kept ("can I" /
# "should I", "when should" / "when do", "what to").
HOW_MODALS = frozenset({"can", "should", "must", "may", "to"})
WH_MODALS = frozenset({"can"})


def _stem(w: str) -> str:
    """Light suffix stemming of one English word: plural / third-person -s, -es, -ies,
    then -ing and -ed, then a final -e ("makes", "making", "make" -> "mak"); a word of
    3 characters or less, and any word holding a digit, is kept as it is."""
    if len(w) <= 3 or not w.isalpha() or not w.isascii():
        return w
    if w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith(("sses", "xes", "ches", "shes", "zes")):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    for suf in ("ing", "ed"):
        if w.endswith(suf) and len(w) - len(suf) >= 3:
            w = w[:-len(suf)]
            break
    if w.endswith("e") and len(w) > 3:
        w = w[:-1]
    return w


def _words(t: str) -> list[str]:
    t = t.lower().replace("\u2019", "'").replace("`", "'")
    for rx, rep in _CONTRACTIONS:
        t = rx.sub(rep, t)
    out = []
    for w in _WORD_RE.findall(t):
        w = DUP_SAME.get(w, w)
        out.extend(w.split())
    return out


def duplicate_key(t: str) -> str:
    """The sequence of content words of ``t``, one string: texts with equal keys ask the
    same question in another wording, independently of any embedding model.

    Lower case; contractions expanded ("what's" -> "what is", "n't" -> " not");
    punctuation removed; the words of :data:`DUP_DROPPED` (articles, auxiliaries, first-
    and second-person pronouns, light function words) dropped; :data:`DUP_SAME` spellings
    merged ("which" -> "what"); a modal or "to" right after "how" dropped (:data:`HOW_MODALS`),
    and "can" right after another wh-word (:data:`WH_MODALS`);
    light suffix stemming (:func:`_stem`). Word order, wh-words,
    negations, numbers, prepositions and every other word are kept, so "2 days" / "3
    days", "Trump is better than Clinton" / the reverse, and "a stranger did for you" /
    "you did for a stranger" keep different keys. When fewer than two words besides
    wh-words would remain ("Who are you?"), only articles are dropped: a short question
    is mostly its function words."""
    words = _words(t)
    content = [w for i, w in enumerate(words) if w not in DUP_DROPPED
               and not (i and words[i - 1] == "how" and w in HOW_MODALS)
               and not (i and words[i - 1] in WH_WORDS and w in WH_MODALS)]
    if sum(w not in WH_WORDS for w in content) < 2:
        content = [w for w in words if w not in ("a", "an", "the")]
    return " ".join(_stem(w) for w in content)


def groups(text1: Sequence[str], text2: Sequence[str],
           label: Sequence[int] | None = None,
           key: Callable[[str], str] = normalise) -> dict[str, int]:
    """``key(text)`` -> group id: union-find over the matching pairs (all pairs when
    ``label`` is None), so texts that recur in several wordings share a group. ``key``
    (default :func:`normalise`) decides which texts are one node: with
    :func:`duplicate_key`, lexical duplicates share a group even when no pair links them."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, (a, b) in enumerate(zip(text1, text2)):
        ra, rb = find(key(a)), find(key(b))
        if (label is None or label[i] == 1) and ra != rb:
            parent[ra] = rb
    roots: dict[str, int] = {}
    return {t: roots.setdefault(find(t), len(roots)) for t in list(parent)}


def mine_negatives(pairs: Pairs, vec1: np.ndarray, vec2: np.ndarray) -> Pairs:
    """Pairs plus one hard negative per query of a positives-only set: ``text2`` against
    the closest ``text1`` (cosine of the L2-normalised ``vec1``/``vec2`` rows) of another
    group. Groups (:func:`groups` with :func:`duplicate_key`) join the texts of each pair
    and the lexical duplicates of a text, so a question that recurs in a trivially
    different wording ("What's ..." / "What is ...") is never mined as a negative of
    itself. Some mined negatives are still recurrences in looser wordings the key does not
    link, so wrong-hit rates on them are upper bounds. Returns ``pairs`` unchanged when it
    already has negatives."""
    if any(v == 0 for v in pairs.label):
        return pairs
    g = groups(pairs.text1, pairs.text2, key=duplicate_key)
    q_group = np.array([g[duplicate_key(t)] for t in pairs.text2])
    e_group = np.array([g[duplicate_key(t)] for t in pairs.text1])
    out = Pairs(list(pairs.text1), list(pairs.text2), list(pairs.label), list(pairs.mined))
    step = 512
    for s in range(0, len(pairs), step):
        sims = vec2[s:s + step] @ vec1.T
        sims[q_group[s:s + step, None] == e_group[None, :]] = -2.0
        best = sims.argmax(axis=1)
        for i, j in enumerate(best):
            if sims[i, j] > -2.0:
                out.text1.append(pairs.text1[j])
                out.text2.append(pairs.text2[s + i])
                out.label.append(0)
                out.mined.append(True)
    return out


def fold_ids(pairs: Pairs, k: int, seed: int = 7) -> np.ndarray:
    """Fold number (0..k-1) per pair for k-fold cross-validation, by connected component
    of texts over the given (not mined) pairs, whatever the label, texts with one
    :func:`duplicate_key` counting as one: pairs sharing a text (or a lexical duplicate of
    it) are in one fold, so no query text of a held-out pair was seen in training. A mined
    negative goes with its query (``text2``)."""
    real = [i for i, m in enumerate(pairs.mined) if not m]
    g = groups([pairs.text1[i] for i in real], [pairs.text2[i] for i in real], None,
               key=duplicate_key)
    comp = np.array([g.get(duplicate_key(t), -1 - i) for i, t in enumerate(pairs.text2)])
    rng = np.random.default_rng(seed)
    ids = np.unique(comp)
    perm = rng.permutation(len(ids))
    fold_of = dict(zip(ids.tolist(), (perm % k).tolist()))
    return np.array([fold_of[c] for c in comp.tolist()], dtype=np.int64)
