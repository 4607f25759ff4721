"""The language of a question, for the semantic cache's language rule.

The precision guard's word lists (negation, numbers, antonyms, persons, the scope checks)
and the verifier's training pairs are English and Chinese. In other languages the guard
sees almost nothing: "wenn ich die Rechnung nicht bezahle" against "... bezahle",
"если я не оплачу штраф" against "... оплачу", 払わなかったら against 払ったら pass every
check, and only the verifier's threshold stands between them and a wrong answer (a
hand-written set of 256 such near-misses in seven other languages had 27 served). So a
semantic hit needs both questions in one language of ``cache.semantic_languages``
(default :data:`GUARDED`); other languages get exact hits only, until an operator lists
them (``["*"]``: any), ideally after ``infergate cache calibrate`` on pairs of their own.

:func:`detect` decides by script first (Hangul: ``ko``; kana: ``ja``, unless a few kana
stand in Chinese text; Han: ``zh``), then with py3langid (langid.py's model, shipped in
the wheel; 0.1-0.25 ms per question, about 86 MB per process) restricted to
:data:`CANDIDATES`, the widely used written languages (the full 97-language model takes
1 % of English questions for Nigerian Pidgin or Latin), with English read at
:data:`EN_MIN_SHARE`: on the cache-eval dev sets 99.85 % of the English questions are
``en`` and 99.9 % of the Chinese ones ``zh``. A greeting of one
word ("Hello!", "Hi") is too short to tell. A text without a letter is
:data:`UNDETERMINED`.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence

#: Languages the guard and the verifier were built and measured on (ISO 639-1).
GUARDED: tuple[str, ...] = ("en", "zh")
#: ``cache.semantic_languages`` entry that allows every language.
ANY = "*"
#: A text with no letter (digits, symbols, emoji only).
UNDETERMINED = "und"
#: What py3langid may answer (ISO 639-1): the widely used written languages. Smaller
#: ones it confuses with English on short questions (pcm, la, bcl) are left out.
CANDIDATES: tuple[str, ...] = (
    "en", "zh", "ja", "ko", "de", "fr", "es", "pt", "it", "nl", "ru", "pl", "tr", "ar",
    "th", "vi", "id", "hi", "he", "el", "uk", "cs", "sv", "da", "no", "fi", "hu", "ro",
    "bg", "hr", "sr", "sk", "sl", "lt", "lv", "et", "fa", "ms", "tl", "bn", "ta", "ur")
#: English wins at this share of py3langid's probability (as written or lower-cased),
#: first or not: 99.85 % of the qqp-en questions reach it (a short one often ranks first
#: as another language); no question of a hand-written German, French, Spanish or
#: Portuguese set got over 0.09.
EN_MIN_SHARE = 0.2
#: A text of at most SHORT_WORDS words in ASCII letters whose likeliest language has
#: under SHORT_MAX_SHARE of the probability is read as English: on 61 short English
#: support and search queries the model put another language first for 15, all under
#: 0.37, while hand-written questions in German, French, Spanish and Portuguese were all
#: above 0.34 and few are that short in ASCII.
SHORT_WORDS = 4
SHORT_MAX_SHARE = 0.4
#: Words of English and of few others in :data:`CANDIDATES` spelled in ASCII ("of",
#: "is", "in", "on", "do", "a", "my", "can", "it" are common words of others). A longer
#: ASCII text the model cannot place (its likeliest language under SHORT_MAX_SHARE) that
#: holds one, with English at EN_UNSURE_SHARE at least, is read as English: "Convert 100
#: euros to US dollars" ranked fr 0.19, es 0.18, en 0.16. (Czech, Slovak and Slovene
#: "to je ..." split between those three with English at 0: not English.)
EN_ONLY_WORDS = frozenset({
    "the", "to", "what", "how", "why", "when", "where", "which", "who", "whose", "you",
    "your", "with", "does", "should", "would", "could", "from", "and", "this", "that",
    "into", "about", "between", "than", "there", "their", "they"})
EN_UNSURE_SHARE = 0.05
#: Characters read (a question's language shows in its first words).
MAX_CHARS = 1000

_KANA_RE = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9d]")
_HANGUL_RE = re.compile(r"[\uac00-\ud7af\u1100-\u11ff\u3130-\u318f]")
_HAN_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
_LETTER_RE = re.compile(r"[^\W\d_]")
_WORD_RE = re.compile(r"[A-Za-z]+")

_lock = threading.Lock()
_identifier = None


def _langid():
    """py3langid's identifier restricted to :data:`CANDIDATES`, loaded once (~0.5 s)."""
    global _identifier
    if _identifier is None:
        with _lock:
            if _identifier is None:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier

                ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
                ident.set_languages(list(CANDIDATES))
                _identifier = ident
    return _identifier


def warm() -> None:
    """Load the language model now (the embedder does at start), not on the first lookup."""
    _langid()


@functools.lru_cache(maxsize=8192)
def detect(text: str) -> str:
    """ISO 639-1 code of ``text`` (its first :data:`MAX_CHARS` characters): ``ko`` with
    Hangul, ``ja`` with kana making at least half as many characters as the Han ones,
    ``zh`` with other Han characters, else py3langid's best of :data:`CANDIDATES` (on the
    lower-cased text; ``en`` whenever English has :data:`EN_MIN_SHARE` of the
    probability, as written or lower-cased; a short or unplaced ASCII text: ``en`` as
    :data:`SHORT_WORDS` and :data:`EN_ONLY_WORDS` say); :data:`UNDETERMINED` without a
    letter."""
    head = text[:MAX_CHARS]
    if _HANGUL_RE.search(head):
        return "ko"
    han = len(_HAN_RE.findall(head))
    if han or _KANA_RE.search(head):
        # a Chinese question may quote a Japanese word (日语中的こころ是什么意思) or use の
        return "ja" if 2 * len(_KANA_RE.findall(head)) >= han else "zh"
    if not _LETTER_RE.search(head):
        return UNDETERMINED
    ident = _langid()
    ranked = ident.rank(head.lower())
    if dict(ranked).get("en", 0.0) >= EN_MIN_SHARE \
            or (head != head.lower() and dict(ident.rank(head)).get("en", 0.0) >= EN_MIN_SHARE):
        return "en"
    if ranked[0][1] < SHORT_MAX_SHARE and head.isascii():
        words = _WORD_RE.findall(head)
        if len(words) <= SHORT_WORDS or (
                dict(ranked).get("en", 0.0) >= EN_UNSURE_SHARE
                and not EN_ONLY_WORDS.isdisjoint(w.lower() for w in words)):
            # "Pricing?", "Refund policy?", "Best pasta recipe": too short for the model
            # to tell; "Convert 100 euros to US dollars": unsure, with a word only English
            # has. Read as English (as before the rule), the guard's English checks apply
            return "en"
    return str(ranked[0][0])


def allowed(lang: str, languages: Sequence[str]) -> bool:
    """Whether a question of ``lang`` may get a semantic hit under ``languages`` (a
    ``cache.semantic_languages`` value)."""
    return ANY in languages or lang in languages


def valid_code(code: str) -> bool:
    """Whether ``code`` may stand in ``cache.semantic_languages``: :data:`ANY` or one of
    :data:`CANDIDATES`."""
    return code == ANY or code in CANDIDATES
