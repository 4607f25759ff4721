"""Guard checks of what a question is about beyond its key terms: its time, its audience
and its kind (:func:`controlplane.embedder.guard.check` calls them).

A sentence embedder and the verifier score these pairs 0.95 and above, and the key-term
check cannot see them (the words are stop words, or only added on one side):

- ``tense``: one question asks about the past, the other about the future ("What did
  Apple announce?" / "What will Apple announce?"): a past auxiliary (did, was, were,
  had) and no future one in one text, a future one (will, shall, 'll, won't) and no past
  one in the other. "What happens" / "What will happen" passes. Present against past
  too, when an auxiliary is all that differs, word for word ("Who is the president of
  France?" / "Who was ...": is, are, am, do, does, has, have against was, were, did,
  had): a question of a fact that changes; the same change of a fact that does not
  ("What is the Bosnian war?" / "What was ...") is a miss, 7 of the 6,000 qqp-en
  paraphrases, all such.
- ``audience``: the people the question is for differ or are named on one side only
  ("What vaccines do I need for Thailand?" / "What vaccines do children need for
  Thailand?", "discounts" / "discounts for students"); words of one group count as one
  (kids = children, 小孩 = 孩子 = 儿童).
- ``question_type``: one text asks what something is and the other how to remedy it
  ("What is a 404 error?" / "How do I fix a 404 error?", 什么是死锁 / 怎么解决死锁); or
  one asks why and the other, the same question without that word, asks whether ("Why
  is my Wi-Fi slow?" / "Is my Wi-Fi slow?": a reason against yes or no).
- ``actor``: the same question of who may or does act, asked of the asker in one text
  and of someone else in the other ("Can I cancel my order after it has shipped?" /
  "Can the seller cancel my order ...?"): after the same auxiliary, "I" or "we" against
  a third person or a noun ("he", "the store", "my landlord"), the rest of the
  question alike. A generic "you" stands for the asker and is neither side ("How do I
  reset my password?" / "How do you reset ..." is a rewording).

The why-question against yes or no, and ``actor``, were written for the two wrong hits
(systematic: "Why is my laptop / order ..." hit too) of a fifth hand-written set (289
pairs; made for that set, it does not measure them).
The rest were written for the wrong hits of a set of hand-written pairs outside the dev data (353,
English and Chinese: 4 wrong hits in 179 non-matching pairs before these checks, 1
after, none of its 56 served matches lost; made for that set, it does not measure them
as held-out data would); on the dev sets' judge part they change no hit
(``bench/cache_quality``). Pure functions, no I/O, never raise on ``str`` input.
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher

from .operators import MAX_CHARS

_WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)?")
_PAST = frozenset({"did", "was", "were", "had", "didn't", "wasn't", "weren't", "hadn't"})
_FUTURE = frozenset({"will", "shall", "won't", "shan't"})
_PRESENT_AUX = frozenset({"is", "are", "am", "do", "does", "has", "have", "isn't", "aren't",
                          "don't", "doesn't", "hasn't", "haven't"})
_PAST_AUX = frozenset({"was", "were", "did", "had", "wasn't", "weren't", "didn't", "hadn't"})

#: People a question can be for, each group read as its first word.
_AUDIENCE_EN: dict[str, str] = {
    w: g[0] for g in (
        ("child", "children", "kid", "kids", "toddler", "toddlers"),
        ("baby", "babies", "infant", "infants", "newborn", "newborns"),
        ("teen", "teens", "teenager", "teenagers", "adolescent", "adolescents"),
        ("adult", "adults"),
        ("senior", "seniors", "elderly"),
        ("pregnant",),
        ("student", "students", "undergraduate", "undergraduates"),
        ("beginner", "beginners", "newbie", "newbies"),
    ) for w in g}
_AUDIENCE_ZH: tuple[tuple[str, str], ...] = (
    ("儿童", "孩子"), ("小孩", "孩子"), ("孩子", "孩子"), ("宝宝", "宝宝"), ("婴儿", "宝宝"),
    ("老年人", "老人"), ("老人", "老人"), ("孕妇", "孕妇"), ("学生", "学生"),
    ("成人", "成人"), ("新手", "新手"),
)

_DEFINITION_RE = re.compile(
    r"^\s*(?:what(?:'s| is| are) (?:a |an |the )?|what does .* mean|define\b)|什么是|是什么",
    re.IGNORECASE)
_REMEDY_EN = frozenset({"fix", "solve", "resolve", "repair", "debug", "treat", "cure",
                        "prevent", "remove", "avoid", "handle", "troubleshoot"})
_REMEDY_ZH = ("解决", "修复", "治疗", "处理", "怎么办", "排查")


def _words(text: str) -> set[str]:
    words = set(_WORD_RE.findall(text[:MAX_CHARS].lower()))
    if any(w.endswith("'ll") for w in words):
        words.add("will")
    return words


def _aux_tense_only(query: str, candidate: str) -> bool:
    """True when the texts' words are the same, in order, but for auxiliaries of the
    present in one and of the past in the other, in the same places."""
    a = _WORD_RE.findall(query[:MAX_CHARS].lower())
    b = _WORD_RE.findall(candidate[:MAX_CHARS].lower())
    if len(a) != len(b):
        return False
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    return bool(diff) and all((x in _PRESENT_AUX and y in _PAST_AUX)
                              or (x in _PAST_AUX and y in _PRESENT_AUX) for x, y in diff)


def tense_changed(query: str, candidate: str) -> bool:
    """True when one text asks about the past and the other about the future, or about
    the present and the past with nothing else changed (:func:`_aux_tense_only`)."""
    def sides(t: str) -> tuple[bool, bool]:
        w = _words(t)
        return bool(w & _PAST), bool(w & _FUTURE)
    (pa, fa), (pb, fb) = sides(query), sides(candidate)
    return ((pa and not fa and fb and not pb) or (pb and not fb and fa and not pa)
            or _aux_tense_only(query, candidate))


def _audience(text: str) -> frozenset[str]:
    t = text[:MAX_CHARS]
    out = {_AUDIENCE_EN[w] for w in _words(t) if w in _AUDIENCE_EN}
    out |= {group for word, group in _AUDIENCE_ZH if word in t}
    return frozenset(out)


def audience_changed(query: str, candidate: str) -> bool:
    """True when the two texts name different audiences (or one names one and the other
    none)."""
    return _audience(query) != _audience(candidate)


def _remedies(text: str) -> set[str]:
    t = text[:MAX_CHARS]
    return (_words(t) & _REMEDY_EN) | {z for z in _REMEDY_ZH if z in t}


def definition_vs_remedy(query: str, candidate: str) -> bool:
    """True when one text asks what something is and the other, not asking that, asks
    how to remedy it (a remedy verb only it has)."""
    for x, y in ((query, candidate), (candidate, query)):
        if _DEFINITION_RE.search(x[:MAX_CHARS]) and not _DEFINITION_RE.search(y[:MAX_CHARS]) \
                and _remedies(y) - _remedies(x):
            return True
    return False


_WH = frozenset({"why", "how", "what", "when", "where", "which", "who", "whom", "whose"})
#: Auxiliaries a yes-or-no question opens with.
_AUX = frozenset({"is", "are", "am", "was", "were", "do", "does", "did", "can", "could",
                  "may", "might", "will", "would", "shall", "should", "must", "has", "have",
                  "had", "isn't", "aren't", "don't", "doesn't", "didn't", "can't", "won't",
                  "shouldn't", "wasn't", "weren't", "hasn't", "haven't"})
#: The asker as the subject; a generic "you" is the asker too and is left out.
_SELF = frozenset({"i", "we"})
#: How a subject other than the asker opens: a third person, or a noun after a definite
#: determiner ("the seller", "my landlord"). "they" and "a"/"an" are left out: "How do
#: they know ..." and "How can an ordinary person ..." ask for anyone, the asker too.
_OTHER = frozenset({"he", "she", "someone", "somebody", "the", "my", "our", "your", "his",
                    "her", "their", "this", "that"})
#: How alike the rest of two questions must be (difflib ratio over their words).
_ALIKE = 0.75


def _seq(text: str) -> list[str]:
    return _WORD_RE.findall(text[:MAX_CHARS].lower())


def _alike(a: list[str], b: list[str]) -> bool:
    return bool(a) and bool(b) and SequenceMatcher(None, a, b, autojunk=False).ratio() >= _ALIKE


def why_vs_yes_no(query: str, candidate: str) -> bool:
    """True when one text opens with "why" and an auxiliary ("Why is ...", "Why should
    ...") and the other, holding no wh-word, is that question without it ("Is ...",
    "Should ..."): a reason asked against a yes or no. "How can I ..." against "Can I
    ..." is left a rewording: who asks whether they can mostly wants the way (14 of the
    42 qqp-en paraphrase pairs such a rule over every wh-word took)."""
    a, b = _seq(query), _seq(candidate)
    for x, y in ((a, b), (b, a)):
        if (len(x) > 2 and x[0] == "why" and x[1] in _AUX and y and y[0] in _AUX
                and not _WH.intersection(y) and _alike(x[1:], y)):
            return True
    return False


def _rest_after_other(words: list[str], rest: list[str]) -> bool:
    """Whether ``words`` (after the auxiliary) open with a subject other than the asker
    (one to three words) followed by a question like ``rest``."""
    if not words or words[0] not in _OTHER:
        return False
    return any(_alike(words[k:], rest) for k in range(1, min(3, len(words) - 1) + 1))


#: The forms of one auxiliary that agree with another subject ("do I" / "does he").
_AGREE = {"does": "do", "am": "is", "are": "is", "has": "have", "doesn't": "don't",
          "aren't": "isn't", "hasn't": "haven't"}


def _opening(words: list[str], i: int) -> list[str]:
    return words[:i] + [_AGREE.get(words[i], words[i])]


def actor_changed(query: str, candidate: str) -> bool:
    """True when both texts open (after an optional wh-word) with the same auxiliary (in
    any agreement: "do I" / "does my landlord"), one has "I" or "we" as its subject, the
    other a third person or a noun, and what follows the subjects is alike."""
    a, b = _seq(query), _seq(candidate)
    for x, y in ((a, b), (b, a)):
        i = 1 if x and x[0] in _WH else 0
        if (len(x) < i + 4 or len(y) < i + 4 or x[i] not in _AUX
                or _opening(y, i) != _opening(x, i)):
            continue
        if x[i + 1] in _SELF and len(x) - i - 2 >= 2 and _rest_after_other(y[i + 1:], x[i + 2:]):
            return True
    return False
