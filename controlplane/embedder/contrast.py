"""Contrast sets: closed classes of English words whose members answer different questions.

"Is the store open on Sunday?" and "Is the store open on Saturday?" differ by one word
and embed at a cosine of 0.96; so do "a soft yolk" / "a hard yolk" and "small packages" /
"large packages". The guard's key-term check sees such a substitution, but on English the
learned verifier may overrule it (it serves the many rewordings that also change a word
or two), and a one-word swap inside a closed class looks to it like a rewording. A swap
within one of the classes below is never a rewording: a text that names members of a
class answers for those members only.

The check (:func:`contrast_conflict`): when both texts name members of a class and not
the same ones, the pair is a different question. A class named in one text only is left
to the other checks ("open on Sunday" / "opening hours" is a rewording). Word forms of
one member (``quick``, ``fast``, ``quickly``) are the same member. Whole words only,
lowercased; ambiguous forms are left out (``may``: the month and the verb; ``fall`` and
``spring``: the season and the verb; ``right``: the side and "correct"; ``light``).

Not used by the learned verifier's features (``verifier.py``), so its calibration is
unchanged; a pure function of the two texts, cached per text.
"""

from __future__ import annotations

import functools
import re

MAX_CHARS = 4000
"""Only the first 4000 characters of each text are read (as the guard's other checks)."""

#: (class name, members); a member is the tuple of its word forms.
CONTRASTS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("weekday", (("monday", "mondays"), ("tuesday", "tuesdays"), ("wednesday", "wednesdays"),
                 ("thursday", "thursdays"), ("friday", "fridays"), ("saturday", "saturdays"),
                 ("sunday", "sundays"))),
    ("month", (("january",), ("february",), ("march",), ("april",), ("june",), ("july",),
               ("august",), ("september",), ("october",), ("november",), ("december",))),
    ("season", (("summer", "summers"), ("winter", "winters"), ("autumn", "autumns"))),
    ("part of day", (("morning", "mornings"), ("afternoon", "afternoons"),
                     ("evening", "evenings"), ("night", "nights", "tonight"))),
    ("compass", (("north", "northern"), ("south", "southern"), ("east", "eastern"),
                 ("west", "western"))),
    ("temperature", (("hot", "hotter", "hottest"), ("cold", "colder", "coldest"))),
    ("hardness", (("soft", "softer", "softest"), ("hard", "harder", "hardest", "firm",
                                                   "firmer"))),
    ("size", (("small", "smaller", "smallest", "tiny"),
              ("large", "larger", "largest", "big", "bigger", "biggest", "huge"))),
    ("height", (("high", "higher", "highest"), ("low", "lower", "lowest"))),
    ("speed", (("fast", "faster", "fastest", "quick", "quicker", "quickest", "quickly"),
               ("slow", "slower", "slowest", "slowly"))),
    ("time", (("early", "earlier", "earliest"), ("late", "later", "latest"))),
    ("open/close", (("open", "opens", "opened", "opening"),
                    ("close", "closes", "closed", "closing"))),
    ("start/stop", (("start", "starts", "started", "starting"),
                    ("stop", "stops", "stopped", "stopping"))),
    ("price", (("cheap", "cheaper", "cheapest", "inexpensive"),
               ("expensive", "costly", "pricey"))),
    ("wet/dry", (("wet", "wetter"), ("dry", "drier", "dryer"))),
    ("thick/thin", (("thick", "thicker"), ("thin", "thinner"))),
    ("full/empty", (("full",), ("empty",))),
    ("win/lose", (("win", "wins", "won", "winning"), ("lose", "loses", "lost", "losing"))),
    ("accept/reject", (("accept", "accepted", "accepting"),
                       ("reject", "rejected", "rejecting", "decline", "declined"))),
    ("allow/block", (("allow", "allowed", "allowing", "permit", "permitted"),
                     ("block", "blocked", "blocking", "ban", "banned", "forbid", "forbidden"))),
    ("positive/negative", (("positive",), ("negative",))),
    ("inside/outside", (("inside", "indoor", "indoors"), ("outside", "outdoor", "outdoors"))),
    ("first/last", (("first",), ("last",))),
    ("gender", (("male", "males", "man", "men", "boy", "boys", "masculine"),
                ("female", "females", "woman", "women", "girl", "girls", "feminine"))),
    ("family", (("mother", "mom", "mum"), ("father", "dad"), ("son", "sons"),
                ("daughter", "daughters"), ("brother", "brothers"), ("sister", "sisters"),
                ("husband",), ("wife",), ("grandmother", "grandma"),
                ("grandfather", "grandpa"), ("aunt",), ("uncle",))),
    ("colour", (("red",), ("yellow",), ("green",), ("blue",), ("purple",), ("pink",),
                ("black",), ("white",), ("brown",), ("gray", "grey"))),
    ("language", (("english",), ("french",), ("spanish",), ("german",), ("italian",),
                  ("portuguese",), ("russian",), ("chinese", "mandarin"), ("japanese",),
                  ("korean",), ("arabic",), ("hindi",), ("dutch",))),
)

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
def members(text: str) -> dict[int, frozenset[int]]:
    """Class -> the members ``text`` names (only the classes it names); cached (the
    entries' texts recur in every lookup of their namespace)."""
    idx = _index()
    found: dict[int, set[int]] = {}
    for w in set(_WORD_RE.findall(text[:MAX_CHARS].lower())):
        hit = idx.get(w)
        if hit is not None:
            found.setdefault(hit[0], set()).add(hit[1])
    return {c: frozenset(m) for c, m in found.items()}


def contrast_conflict(query: str, candidate: str) -> str | None:
    """Name of the first class both texts name with different members, else None.

    "open on Sunday" / "open on Saturday" -> ``"weekday"``; "open on Sunday" / "opening
    hours on Sunday" -> None; "a soft yolk" / "a runny yolk" -> None (one side only).
    Never raises for ``str`` inputs."""
    mq, mc = members(query), members(candidate)
    if not mq or not mc:
        return None
    for ci in sorted(mq.keys() & mc.keys()):
        if mq[ci] != mc[ci]:
            return CONTRASTS[ci][0]
    return None
