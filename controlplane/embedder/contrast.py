"""Contrast sets: closed classes of English words whose members answer different questions.

"Is the store open on Sunday?" and "Is the store open on Saturday?" differ by one word
and embed at a cosine of 0.96; so do "a soft yolk" / "a hard yolk" and "small packages" /
"large packages". The guard's key-term check sees such a substitution, but on English the
learned verifier may overrule it (it serves the many rewordings that also change a word
or two), and a one-word swap inside a closed class looks to it like a rewording. A swap
within one of the classes below is never a rewording: a text that names members of a
class answers for those members only.

The check (:func:`contrast_conflict`): when each text names a member of a class that
the other does not (a substitution: "Sunday" / "Saturday"), or, for the pronouns, the
same ones in another order ("Does he owe her money?" / "Does she owe him money?"), the
pair is a different question. A class named in one text only, or with the members of
one text among the other's ("start it up" / "slowing it down on start up"), is left to
the other checks ("open on Sunday" / "opening hours" is a rewording). Word forms of one
member (``quick``, ``fast``, ``quickly``) are the same member. Whole words, lowercased;
the classes and the forms that need their context ("in May", "9 pm", "zoom out", "the
US") are in :mod:`.contrast_words`. Then a word one text negates with a prefix ("safe" / "unsafe",
"effective" / "ineffective", "useful" / "useless") is a different question too.

Not used by the learned verifier's features (``verifier.py``), so its calibration is
unchanged; a pure function of the two texts, cached per text.
"""

from __future__ import annotations

import functools
import re

from .contrast_words import CONTRASTS, PATTERNS, PREFIXES
from .operators import MAX_CHARS

_WORD_RE = re.compile(r"[a-z]+")


@functools.lru_cache(maxsize=1)
def _index() -> dict[str, tuple[int, int]]:
    """Word form -> (class, member)."""
    out: dict[str, tuple[int, int]] = {}
    for ci, (_, members) in enumerate(CONTRASTS):
        for mi, forms in enumerate(members):
            for w in forms:
                out[w] = (ci, mi)
    return out


@functools.lru_cache(maxsize=8192)
def _spots(text: str) -> tuple[tuple[int, int, int], ...]:
    """Every place ``text`` names a member of a class: ``(position, class, member)``
    sorted by position, each place once (a word and a pattern may find the same one)."""
    t = text[:MAX_CHARS]
    idx = _index()
    spots: set[tuple[int, int, int]] = set()
    for m in _WORD_RE.finditer(t.lower()):
        hit = idx.get(m.group())
        if hit is not None:
            spots.add((m.start(), *hit))
    for rx, form in PATTERNS:
        for m in rx.finditer(t):
            spots.add((m.start(), *idx[form]))
    return tuple(sorted(spots))


@functools.lru_cache(maxsize=8192)
def members(text: str) -> dict[int, tuple[int, ...]]:
    """Class -> the members ``text`` names, in the order they first appear (only the
    classes it names); cached (the entries' texts recur in every lookup of their
    namespace)."""
    found: dict[int, list[int]] = {}
    for _, ci, mi in _spots(text):
        seen = found.setdefault(ci, [])
        if mi not in seen:
            seen.append(mi)
    return {c: tuple(m) for c, m in found.items()}


@functools.lru_cache(maxsize=8192)
def member_counts(text: str) -> dict[int, dict[int, int]]:
    """Class -> member -> how many times ``text`` names it (as :func:`members` finds
    them, each place counted): "7:45 am to 8:30 am ... 6:15 pm" names ``am`` twice and
    ``pm`` once."""
    out: dict[int, dict[int, int]] = {}
    for _, ci, mi in _spots(text):
        per = out.setdefault(ci, {})
        per[mi] = per.get(mi, 0) + 1
    return out


#: Classes whose order tells who does what to whom ("he owes her" / "she owes him"); in
#: the others an order is a list ("French and German" / "German and French").
ORDERED = frozenset(ci for ci, (name, _) in enumerate(CONTRASTS) if name == "pronoun")


#: A negating prefix written with a hyphen ("non-toxic", "un-American"): read as one word.
_HYPHEN_PREFIX_RE = re.compile(
    r"\b(" + "|".join(sorted({p for p, _ in PREFIXES}, key=len, reverse=True)) + r")-(?=[a-z])")


@functools.lru_cache(maxsize=8192)
def _words(text: str) -> frozenset[str]:
    t = _HYPHEN_PREFIX_RE.sub(r"\1", text[:MAX_CHARS].lower())
    return frozenset(_WORD_RE.findall(t))


def _negated_form(a: frozenset[str], b: frozenset[str]) -> str | None:
    """A word of ``a`` (not of ``b``) that is a word of ``b`` (not of ``a``) with a
    negating prefix ("safe" / "unsafe"), or with -less for -ful ("useful" / "useless")."""
    for w in a - b:
        for prefix, least in PREFIXES:
            if len(w) >= least and prefix + w in b and prefix + w not in a:
                return prefix + w
        if w.endswith("ful") and w[:-3] + "less" in b and w[:-3] + "less" not in a:
            return w[:-3] + "less"
    return None


def contrast_conflict(query: str, candidate: str) -> str | None:
    """Name of the first class in which each text names a member the other does not
    (pronouns: or the same in another order), else ``"prefix"`` when one text negates a
    word of the other with a prefix, else None.

    "open on Sunday" / "open on Saturday" -> ``"weekday"``; "Does he owe her money?" /
    "Does she owe him money?" -> ``"pronoun"``; "Is tap water safe?" / "Is tap water
    unsafe?" -> ``"prefix"``; "open on Sunday" / "opening hours on Sunday" -> None; "a
    soft yolk" / "a runny yolk" -> None (the class in one text only). Never raises for
    ``str`` inputs."""
    mq, mc = members(query), members(candidate)
    for ci in sorted(mq.keys() & mc.keys()):
        a, b = mq[ci], mc[ci]
        sa, sb = set(a), set(b)
        if (sa - sb and sb - sa) or (ci in ORDERED and sa == sb and a != b):
            return CONTRASTS[ci][0]
    wq, wc = _words(query), _words(candidate)
    if _negated_form(wq, wc) or _negated_form(wc, wq):
        return "prefix"
    return None
