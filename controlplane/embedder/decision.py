"""The semantic cache's decision on a query's candidates, as the embedder serves it.

:func:`choose` is the one function that decides a hit: :class:`engine.Engine` calls it on
every lookup, and ``bench/cache_quality`` calls it to measure hit and wrong-hit rates, so
the figures the documentation quotes are those of the serving path (cosine threshold, the
precision guard, characters the model does not know, the verifier and its threshold).

Pure logic besides the callbacks it is given (``live``: the entry still exists; ``embed``:
vectors of candidates stored without one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from controlplane.embedder import guard as guard_mod
from controlplane.embedder import language
from controlplane.embedder.index import Candidate
from controlplane.embedder.verifier import Verifier, same_words


def verify(verifier: Verifier, text: str, vec: np.ndarray, cands: Sequence[Candidate],
           embed: Callable[[list[str]], np.ndarray] | None = None) -> list[float]:
    """Verifier probabilities (0-1) of ``cands`` for the query ``text`` (unit vector
    ``vec``, shape (dim,)); a candidate without a stored vector of that shape is embedded
    by ``embed``. Raises ``ValueError`` when one lacks a vector and ``embed`` is None."""
    dim = vec.shape[-1]
    missing = [i for i, c in enumerate(cands) if c.vec is None or c.vec.shape != (dim,)]
    vecs = [c.vec for c in cands]
    if missing:
        if embed is None:
            raise ValueError("a candidate has no vector and nothing can embed it")
        for i, v in zip(missing, embed([cands[i].text for i in missing])):
            vecs[i] = v
    v = np.vstack(vecs).astype(np.float32, copy=False)
    u = np.repeat(vec[None, :], len(cands), axis=0)
    return [float(x) for x in verifier.score([text] * len(cands), [c.text for c in cands],
                                             u, v)]


def guard_verdict(text: str, candidate: str, verifying: bool,
                  unknown: Callable[[str], object] | None = None,
                  verbatim: bool = False) -> guard_mod.GuardResult:
    """The precision guard's verdict on serving ``candidate`` for the query ``text`` on
    the serving path: :func:`guard.check`, then the model's unknown characters (``unknown``
    gives a text's characters outside the model's vocabulary; they must agree). When the
    verifier decides (``verifying``), a rejection it may overrule
    (:func:`guard.verifier_may_overrule`: an English key-term substitution, which the
    verifier sees as a feature) passes with the label ``pass:verifier``, so the verifier's
    probability decides: at the configured threshold when the words that differ are
    spelled alike (:func:`guard.spelling_variant`), else at
    :data:`guard.SUBSTITUTION_MIN_SCORE` at least (``min_score`` of the result). So does
    a pair the guard passed where one English question for an amount adds a qualifier
    (:func:`guard.qualifier_added`). ``verbatim``: the texts are completion prompts
    (:func:`guard.check`)."""
    g = guard_mod.check(text, candidate, verbatim)
    if g.ok and unknown is not None and unknown(text) != unknown(candidate):
        return guard_mod.GuardResult(False, "unknown_chars")
    if not g.ok and verifying and guard_mod.verifier_may_overrule(g, text, candidate):
        if guard_mod.spelling_variant(text, candidate):
            return guard_mod.VERIFIER_DECIDES
        return guard_mod.VERIFIER_DECIDES_SUBSTITUTION
    if g.ok and verifying and guard_mod.qualifier_added(text, candidate):
        return guard_mod.VERIFIER_DECIDES_SUBSTITUTION
    return g


def served_score(g: guard_mod.GuardResult, score: float) -> float:
    """The verifier's ``score`` of a pair the guard passed with ``g``, as a threshold
    sweep must read it: unchanged, or -1 (never served) when below ``g.min_score``."""
    return score if g.min_score is None or score >= g.min_score else -1.0


def choose(text: str, vec: np.ndarray | None, cands: Sequence[Candidate], threshold: float,
           min_score: float | None, use_guard: bool, verifier: Verifier | None,
           live: Callable[[Candidate], bool] | None = None,
           unknown: Callable[[str], object] | None = None,
           embed: Callable[[list[str]], np.ndarray] | None = None,
           on_reject: Callable[[str], None] | None = None,
           languages: Sequence[str] | None = language.GUARDED,
           verbatim: bool = False,
           ) -> tuple[Candidate | None, str | None, float | None]:
    """``(hit, verdict, best verifier score)`` among ``cands`` (best first) for the query
    ``text``: the first with similarity >= ``threshold`` that passes the guard (when
    ``use_guard``: :func:`guard_verdict`; ``unknown`` gives a text's characters outside
    the model's vocabulary, which must agree), the verifier (when ``min_score`` and
    ``verifier`` are set: its probability >= ``min_score``) and ``live`` (None: taken as
    live). ``verdict`` is the guard's label of the hit (``pass``, ``pass:verifier``),
    else the first rejection (``reject:<reason>``, ``reject:verifier``), else None;
    ``on_reject`` is told ``guard`` or ``verifier`` per rejected candidate.

    With the guard, ``languages`` (``cache.semantic_languages``; None: no such rule) is the
    language rule (:mod:`.language`): a candidate in another language than the query's,
    or any candidate of a query whose language is not in ``languages`` unless it is the
    same question up to case, spaces and punctuation (:func:`verifier.same_words`), is
    rejected (``reject:language``). ``verbatim``: the texts are ``/v1/completions``
    prompts (:func:`guard.check`)."""
    hit: Candidate | None = None
    verdict: str | None = None
    best_score: float | None = None
    verifying = min_score is not None and vec is not None and verifier is not None
    lang, foreign = None, False
    if use_guard and languages is not None:
        lang = language.detect(text)
        foreign = not language.allowed(lang, languages)
    for c in cands:
        if c.similarity < threshold:
            continue
        if not use_guard:
            if live is None or live(c):
                hit = c
                break
            continue
        if lang is not None and (language.detect(c.text) != lang
                                 or (foreign and not same_words(text, c.text))):
            g = guard_mod.GuardResult(False, "language")
        else:
            g = guard_verdict(text, c.text, verifying, unknown, verbatim)
        if not g.ok:
            if on_reject is not None:
                on_reject("guard")
            verdict = verdict or g.label
            continue
        if verifying:
            assert min_score is not None and vec is not None and verifier is not None
            # one candidate at a time: a hit on the first spares the others' features
            score = verify(verifier, text, vec, [c], embed)[0]
            best_score = score if best_score is None else max(best_score, score)
            if served_score(g, score) < min_score:
                if on_reject is not None:
                    on_reject("verifier")
                verdict = verdict or "reject:verifier"
                continue
            best_score = score
        if live is not None and not live(c):
            continue
        verdict = g.label
        hit = c
        break
    return hit, verdict, best_score
