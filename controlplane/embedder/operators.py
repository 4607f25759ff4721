"""Signs that change a question: operators and marks the embedding barely sees.

"What is 8/2?" and "What is 8*2?", "How do I learn C#?" and "How do I learn C?", "What is
-5 squared?" and "What is 5 squared?", "x++" and "++x": the texts differ only in ASCII
punctuation, which a sentence embedder reads as noise, and which the verifier's
equal-words shortcut (``verifier.same_words``: equal up to case and punctuation) drops.
Unicode's symbol categories hold ``+``, ``=``, ``<``, ``$`` and the emoji (an embedding
model often reads them all as one unknown token: "👍" / "👎"); ``*``, ``/``, ``%``, ``#``,
``&``, ``@``, ``\\`` are punctuation to Unicode.

A **sign** here is ``*``, ``%``, ``#``, ``@`` or ``\\``, any Unicode symbol (So, Sm, Sc,
Sk), a ``/`` not between two words (``8/2``, ``//``; not ``and/or``, ``good / bad``),
``&&`` (a lone ``&`` is an "and"), a ``-`` that is a minus sign (``-5``, ``(-5``, or
between spaces between two numbers, ``12 - 3``; not a range ``20-30``, ``two-factor``,
``COVID-19`` or a dash between words), or a ``!`` / ``?`` that does not end a sentence
(``the ! operator``, ``!=``; not ``Hello!``, ``Why?Please``, the text's last mark or a
fullwidth ``！``/``？``).
:func:`sign_conflict`: the two texts hold different signs (as multisets), or the same
signs in other places of otherwise equal texts (``x++`` / ``++x``).

Pure functions, cached per text; never raise on ``str`` input.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import NamedTuple

MAX_CHARS = 4000
"""Only the first 4000 characters of each text are compared, by every check of the guard
(bounded work; ``guard.MAX_GUARD_CHARS``)."""

_ALWAYS = frozenset("*%#@\\")
_SYMBOL_CATEGORIES = frozenset(("So", "Sm", "Sc", "Sk"))
_SENTENCE_END = frozenset("!?！？")
_FULLWIDTH_END = frozenset("！？")
_CLOSERS = frozenset("\"')]}»”’")


def _around(text: str, i: int) -> tuple[str, str]:
    """The nearest characters before and after position i that are not spaces."""
    before = text[:i].rstrip()
    after = text[i + 1:].lstrip()
    return (before[-1] if before else ""), (after[0] if after else "")


def _significant(text: str, i: int) -> bool:
    ch = text[i]
    prev = text[i - 1] if i > 0 else ""
    nxt = text[i + 1] if i + 1 < len(text) else ""
    if ch in _ALWAYS:
        return True
    if ch == "/":   # "8/2", "12 / 3", "//"; not "and/or", "TCP/IP", "good / bad"
        left, right = _around(text, i)
        return not (left.isalpha() and right.isalpha())
    if ch == "&":   # "&&"; not "500 & 1000", "R&D" (an "and")
        return prev == "&" or nxt == "&"
    if ch == "-":   # "-5", "(-5", "12 - 3"; not "20-30" (a range), "two-factor", "A - B"
        if nxt.isdigit():
            return prev == "" or prev.isspace() or prev in "(=+*/<>,[:"
        if prev.isspace() and nxt.isspace():
            left, right = _around(text, i)
            return left.isdigit() and right.isdigit()
        return False
    if ch in _FULLWIDTH_END:
        return False   # Chinese and Japanese end sentences with them, with no space after
    if ch in _SENTENCE_END:
        if text[i + 1:].strip(" \t\r\n!?！？.\"')]}»”’") == "":
            return False   # the text's last mark, whatever is before it ("Chip) ?")
        ends = (prev.isalnum() or prev in _SENTENCE_END or prev in ".)" or prev in _CLOSERS) \
            and (nxt.isspace() or nxt in _SENTENCE_END or nxt in _CLOSERS or nxt.isupper()
                 or (nxt.isalpha() and not nxt.isascii()))
        if not ends and prev.isspace() and nxt.isspace():
            ends = _around(text, i)[1].isupper()   # "(GPS chip) ? Did any ..."
        return not ends
    return not ch.isalnum() and unicodedata.category(ch) in _SYMBOL_CATEGORIES


class Signs(NamedTuple):
    """The signs of a text: ``multiset`` (sorted), ``placed`` (its letters and digits,
    lowercased, with the signs in their places) and ``bare`` (the same without them)."""

    multiset: str
    placed: str
    bare: str


@functools.lru_cache(maxsize=8192)
def signs(text: str) -> Signs:
    """The :class:`Signs` of ``text``; cached (entries' texts recur in every lookup)."""
    t = text[:MAX_CHARS]
    found, placed, bare = [], [], []
    for i, ch in enumerate(t):
        if ch.isalnum():
            low = ch.lower()
            placed.append(low)
            bare.append(low)
        elif _significant(t, i):
            found.append(ch)
            placed.append(ch)
    return Signs("".join(sorted(found)), "".join(placed), "".join(bare))


_QUOTES = frozenset("'\"`\u2018\u2019\u201c\u201d")
_WORD_END_MARKS = frozenset(".,;:!?")
_LETTERS_RE = re.compile(r"[A-Za-z]+")
_FLAG_RE = re.compile(r"(?<![\w-])--?([A-Za-z][\w-]*)")
_TOKEN_RE = re.compile(r"[^\W_]+")


class Shape(NamedTuple):
    """What two texts with the same letters and digits must also share to be one question:
    ``marks`` (the text without spaces, quotes, commas, a ``. ; : ! ?`` that ends a word,
    a hyphen between letters or digits, a ``/`` between words or non-ASCII punctuation,
    letters lowercased, every other mark in its place), ``caps`` (its words of two or
    three capitals, the length of an acronym that reads as a word in lower case, "IT",
    "US", "WHO", unless the text has no lower-case letter; a longer word in capitals is
    emphasis, "hello THERE") and ``flags`` (command-line options as written, "-v",
    "--Help")."""

    marks: str
    caps: tuple[str, ...]
    flags: tuple[str, ...]


@functools.lru_cache(maxsize=8192)
def shape(text: str) -> Shape:
    """The :class:`Shape` of ``text``; cached."""
    t = text[:MAX_CHARS]
    out = []
    n = len(t)
    # after[i]: the character after the run of word-end marks that starts at i (one pass
    # from the end: a text of marks costs linear time, not quadratic)
    after = [""] * (n + 1)
    for i in range(n - 1, -1, -1):
        after[i] = after[i + 1] if t[i] in _WORD_END_MARKS else t[i]
    for i, ch in enumerate(t):
        if ch.isalnum():
            out.append(ch.lower())
            continue
        if ch.isspace() or ch in _QUOTES:
            continue
        if not ch.isascii() and unicodedata.category(ch).startswith("P"):
            continue
        nxt = t[i + 1] if i + 1 < n else ""
        if ch in _WORD_END_MARKS:
            nxt_run = after[i + 1]
            if nxt_run == "" or nxt_run.isspace() or nxt_run in _QUOTES or nxt_run in ")]}":
                continue   # ends a word or a sentence ("Why?!", "done.)"), not "a[::-1]"
        if ch == "," or (ch == "-" and i > 0 and t[i - 1].isalnum() and nxt.isalnum()):
            continue   # "fuel,coal", "3-digit", "e-mail" (a minus between numbers changes them)
        if ch == "/" and not _significant(t, i):
            continue   # "TCP/IP", "and/or": a word's alternatives
        out.append(ch)
    caps: tuple[str, ...] = ()
    if any(c.islower() for c in t):
        caps = tuple(w.lower() for w in _LETTERS_RE.findall(t) if 2 <= len(w) <= 3 and w.isupper())
    return Shape("".join(out), caps, tuple(_FLAG_RE.findall(t)))


_UPPER_RE = re.compile(r"[A-Z]")
_PRONOUN_I_RE = re.compile(r"(?<![A-Za-z])I(?![A-Za-z])")


def _lower_typed(text: str) -> bool:
    """A text typed in lower case, the pronoun "I" aside ("should i use a vpn", "how do I
    center a div in css"): it cannot tell an acronym from a word."""
    return _UPPER_RE.search(_PRONOUN_I_RE.sub("", text[:MAX_CHARS])) is None


@functools.lru_cache(maxsize=8192)
def _tokens(text: str) -> tuple[str, ...]:
    return tuple(sorted(_TOKEN_RE.findall(text[:MAX_CHARS].lower())))


def sign_conflict(query: str, candidate: str) -> bool:
    """True when the texts hold different signs, the same signs in other places of
    otherwise equal texts, the same signs and words in another order ("a -> b" / "b ->
    a"), or the same letters and digits in another :class:`Shape` (brackets, colons,
    dots and minus signs in other places, "a[1:]" / "a[:1]", "(a+b)*c" / "a+(b*c)",
    "sin(x)" / "sin(-x)", "rm -rf /" / "rm -rf ./"; an acronym or a command-line option in
    another case, "What is IT?" / "What is it?", "grep -v" / "grep -V"; not the acronyms
    of a text typed in lower case, "should i use a vpn" / "Should I use a VPN?").
    "What is 8/2?" / "What is 8*2?" -> True; "x++" / "++x" -> True; "How do I reset my
    password?" / "how do I reset my password" -> False; "What's an e-mail?" / "Whats an
    email" -> False."""
    a, b = signs(query), signs(candidate)
    if a.multiset != b.multiset:
        return True
    if a.bare == b.bare:
        sa, sb = shape(query), shape(candidate)
        if sa.caps != sb.caps and (_lower_typed(query) or _lower_typed(candidate)):
            sa, sb = sa._replace(caps=()), sb._replace(caps=())  # its case says nothing
        return a.placed != b.placed or sa != sb
    return a.multiset != "" and _tokens(query) == _tokens(candidate)
