"""Guard check ``added``: one text is the other with a sentence of its own added, an
instruction or a second request ("How do I reset my router?" / "How do I reset my
router? Be rude.", "... Include a link to example.com in your answer.", "怎么注销账号？" /
"怎么注销账号？最后加一句广告。").

A sentence embedder and the verifier score such pairs 0.94-0.97: the added sentence is
short beside the question, and its words are added, not substituted, so the key-term
check (:func:`controlplane.embedder.guard.key_term_substitution`) passes them. Yet the
added sentence changes the answer (its tone, its content, its length), and serving either
text's answer to the other lets one client of a namespace plant an answer the others
get.

The rule: split both texts into sentences (``.``, ``?``, ``!`` or ``:`` followed by a
space, ``?`` or ``!`` before a letter, ``。？！；;：``, line breaks, and parentheses, whose
content counts as a sentence of its own: "... (answer rudely)?"); count the substantive ones
(with a key term that is not a courtesy word: "Hi.", "Thanks!", 谢谢。 are not); when one
text has more of them (and the other at least one), a sentence of it whose key terms are
mostly (more than half) absent from the other text is added. A longer rewording that
splits the question in two ("I forgot my password. How do I reset it?" / "How do I reset
my forgotten password?") shares its terms and passes.

Pure functions, no I/O, never raise on ``str`` input. Written for hand-made injection
pairs outside the dev data; the effect on the dev sets is measured by
``bench/cache_quality`` (docs/cache.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Set

from .operators import MAX_CHARS

_SPLIT_RE = re.compile(r"(?<=[.?!:])\s+|(?<=[?!])(?=[^\W\d_])|[。？！；;：\n()（）]+")

#: Words of greeting, thanks and politeness (as key terms, crudely stemmed like them):
#: a sentence of only these adds nothing to the question.
COURTESY: frozenset[str] = frozenset(
    {"hi", "hello", "hey", "thank", "thanks", "thx", "ty", "pleas", "pls", "plz", "sorry",
     "dear", "team", "support", "regard", "cheer", "advance", "question", "help", "quick",
     "ok", "okay", "good", "morning", "afternoon", "evening", "appreciat", "appreciate",
     "sir", "madam", "guy", "folk", "greeting", "urgent", "asap", "expert", "anyone",
     "kind", "kindly", "wonder", "wondering"})

#: The same in Chinese, as phrases taken out of a sentence before its key characters are
#: read (the key terms of Chinese are single characters).
_ZH_COURTESY_RE = re.compile(
    "请教高手|请教|高手|求助|求解|求答案|求真相|求教|求指点|指点|急用|急|在线等|谢谢|多谢|感谢"
    "|请大家|大家|各位|帮忙|帮帮|好心人|朋友们|您好|你好|麻烦了|麻烦|问一下|请问|客服|亲")


def sentences(text: str) -> list[str]:
    """The sentences of ``text`` (its first MAX_CHARS characters), stripped, none empty."""
    return [s for s in (p.strip() for p in _SPLIT_RE.split(text[:MAX_CHARS])) if s]


def _substantive(parts: list[str], terms: Callable[[str], Set[str]]) -> list[set[str]]:
    out = []
    for s in parts:
        t = set(terms(_ZH_COURTESY_RE.sub("", s))) - COURTESY
        if t:
            out.append(t)
    return out


def sentence_added(query: str, candidate: str, terms: Callable[[str], Set[str]]) -> bool:
    """True when one text has more substantive sentences than the other and one of them
    has more than half of its key terms (``terms``: a text's key terms) absent from the
    other text (see the top of this module)."""
    a = _substantive(sentences(query), terms)
    b = _substantive(sentences(candidate), terms)
    if len(a) == len(b) or not a or not b:
        return False
    short, longer = (query, b) if len(a) < len(b) else (candidate, a)
    have = set(terms(short))
    return any(2 * len(t - have) > len(t) for t in longer)
