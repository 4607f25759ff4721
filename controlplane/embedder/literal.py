"""Literal text: where the same words in another case, spacing or punctuation ask
something else.

Two texts equal up to case, spaces and punctuation are scored 1 by the verifier
(``verifier.same_words``): "How do I reset my password?" / "how do i reset my password".
Where the spelling is itself the subject they are different questions, and
:func:`literal_conflict` says so (the guard's ``literal`` rejection). For such texts:

- a text of several lines (code, YAML, a poem): its lines, indentation included, must
  be the same (trailing spaces and blank lines aside): ``if True:\\nprint(1)`` /
  ``if True:\\n    print(1)``;
- a "?" or "!" on a word inside a sentence must be the same: "the regex ab? match" /
  "the regex ab match", "x! do" / "x? do", "5! is" / "5 is" (one that ends a sentence,
  "Why?! Is the sky blue" / "why is the sky blue", does not count, nor do commas,
  hyphens or quote marks: "two-factor" / "two factor", "What does 'ubiquitous' mean?" /
  "What does ubiquitous mean?");
- in Chinese, the marks must not cut the text elsewhere ("下雨天，留客天，留我不？留！" /
  "下雨天留客，天留我不留。"; "你好！" / "你好，" or a mark added, "在哪里" / "在：哪里？", is
  one question);
- quoted text must be the same and in the same order (below);
- a contraction against the word it spells without its apostrophe: "we're" / "were",
  "I'll" / "ill" (:data:`CONTRACTED_WORDS`; "what's" / "whats" and "it's" / "its",
  most often a typo, are one question);
- a capitonym inside a sentence: "Is Turkey in Europe?" / "Is turkey in Europe?"
  (:data:`CAPITONYMS`); other case differences are rewordings ("jQuery" / "JQuery",
  "President Obama" / "president Obama"), and a text written all in capitals or all in
  lower case says nothing about case;
- a question about the writing itself (punctuation, commas, capital letters, spelling,
  grammar, indentation, 标点, 大写, 拼写 …) must be the same but for the spaces around it
  and runs of spaces ("Fix the punctuation: hello world" / "… Hello, world!").

Quoted text (``'…'``, ``"…"``, `````…`````, ``“…”``, ``‘…’``, ``「…」``, ``『…』``), when both
texts quote and the quotes hold the same words, also when the rest of the texts
differs: the quotes must agree in spacing and punctuation ("How long is 'a b'?" / "…
'ab'?", "'However I disagree'" / "'However, I disagree'"), and in case when a quote is
short or a capitonym ("print('A' + 'b')" / "print('a' + 'b')", "Translate 'Polish'" /
"Please translate 'polish'"); the marks that end a quote do not count.

With ``verbatim`` (``/v1/completions`` prompts, whose continuation follows their last
characters), texts equal up to case, spaces and punctuation must be equal up to case
alone: "Once upon a time" / "Once upon a time " or "Roses are red," / "Roses are red."
continue differently.

Pure functions of the two texts, cached per text; never raise on ``str`` input. None of
the labelled dev sets' pairs is rejected by it (16,401 pairs).
"""

from __future__ import annotations

import functools
import re
import unicodedata

from .operators import MAX_CHARS

#: Words whose capital makes another word (a nationality, a country, a month, a name).
CAPITONYMS = frozenset({
    "polish", "turkey", "china", "march", "may", "august", "mercury", "bill", "nice",
    "reading", "job", "rose", "frank", "sue", "will", "chile", "hungary", "jersey",
    "java", "apple", "amazon", "windows", "word", "office", "us", "who", "it",
})

#: Words that a contraction spells without its apostrophe: "we're" / "were" are two
#: questions; "what's" / "whats" is one, and so is "it's" / "its" (most often a typo).
CONTRACTED_WORDS = frozenset({
    "were", "well", "ill", "hell", "shell", "wed", "id", "shed", "lets", "wont", "cant",
    "hed", "whos", "youre", "theyre",
})

#: Quoted text of at most this many characters differs in its case too ('A' / 'a').
SHORT_QUOTE = 2

_PLAIN_RE = re.compile(r"[\W_]+")
_CONTRACTION_RE = re.compile(r"\w+['’]\w+")
_WORD_RE = re.compile(r"\w+")
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK_RE = re.compile(f"[{_CJK}]")
_CJK_SPACE_RE = re.compile(rf"(?<=[{_CJK}])\s+(?=[{_CJK}])")
#: A "?" or "!" after a word and before another: "the regex ab? match", "Why?! Is".
_MARK_RE = re.compile(r"(?<=[A-Za-z0-9_])[?!]+(?=[ \t]*[A-Za-z0-9_(.])")
#: What follows a mark on a word inside a sentence ("ab? match", "x! do", "5!is"), not
#: one that ends a sentence ("Why?! Is", "Hello! How").
_TIGHT_AFTER_RE = re.compile(r"[ \t]+[a-z]|[A-Za-z0-9_(.]")
#: Sentence ends: the word after one starts a sentence.
_SENTENCE_END_RE = re.compile(r"[.?!。？！:;\n]")
_CASED_RE = re.compile(r"\w+|" + _SENTENCE_END_RE.pattern)
#: A question about writing itself: then the texts must be the same but for the spaces
#: around them ("Fix the punctuation: hello world" / "… Hello, world!").
_META_RE = re.compile(
    r"\b(?:punctuat\w*|commas?|apostrophes?|capital letters?|capitals|capitali[sz]\w*|"
    r"upper ?case|lower ?case|spell\w*|grammar|grammatical\w*|typos?|hyphen\w*|"
    r"semicolons?|quotation\w*|whitespace|indent\w*|case[- ]sensitive)\b|"
    r"标点|逗号|句号|大写|小写|拼写|语法|错别字|断句", re.I)
_QUOTE_CHAR_RE = re.compile("['\"`“‘「『]")
_QUOTES = (
    # a single quote opens and closes only off a word: the one of "it's" stays inside
    re.compile(r"(?<!\w)'((?:[^'\n]|(?<=\w)'(?=\w))+)'(?!\w)"),
    re.compile(r"(?<!\w)‘((?:[^‘’\n]|(?<=\w)’(?=\w))+)’(?!\w)"),
    re.compile(r'"([^"\n]+)"'),
    re.compile(r"“([^”\n]+)”"),
    re.compile(r"`([^`]+)`"),
    re.compile(r"「([^」]+)」"),
    re.compile(r"『([^』]+)』"),
)
_QUOTE_END_RE = re.compile(r"[\s.?!。？！]+$")
_SPACE_RE = re.compile(r"\s+")
_BLANKS_RE = re.compile(r"[ \t]+")


def _plain(text: str) -> str:
    return _PLAIN_RE.sub("", text.lower())


@functools.lru_cache(maxsize=8192)
def _plain_of(text: str) -> str:
    return _plain(unicodedata.normalize("NFKC", text[:MAX_CHARS]))


@functools.lru_cache(maxsize=8192)
def _quotes(text: str) -> tuple[str, ...]:
    """The quoted spans of a text, in order, without the marks that end them."""
    t = unicodedata.normalize("NFKC", text[:MAX_CHARS]).replace('""', '"')
    spans = sorted((m.start(), m.group(1)) for rx in _QUOTES for m in rx.finditer(t))
    return tuple(_QUOTE_END_RE.sub("", q) for _, q in spans)


def _quote_key(q: str) -> str:
    """What two quotes must share: the text (its runs of spaces as one) when short or a
    capitonym, else that text up to case."""
    q = _SPACE_RE.sub(" ", q)
    if len(q) <= SHORT_QUOTE or q.lower() in CAPITONYMS:
        return q
    return q.lower()


@functools.lru_cache(maxsize=8192)
def _form(text: str) -> tuple:
    """(lines, bare words, marks on words, cased words, contractions without their
    apostrophe, CJK breaks, meta) of a text cut to MAX_CHARS (module docstring)."""
    t = unicodedata.normalize("NFKC", text[:MAX_CHARS])
    lines = tuple(ln.rstrip() for ln in t.strip("\n").splitlines() if ln.strip())
    flat = _CJK_SPACE_RE.sub("", t)
    marks = {len(_WORD_RE.findall(flat, 0, m.start())):
             (m.group(), _TIGHT_AFTER_RE.match(flat, m.end()) is not None)
             for m in _MARK_RE.finditer(flat)}
    bare = frozenset(_WORD_RE.findall(_CONTRACTION_RE.sub(" ", flat).lower()))
    contracted = frozenset(m.group().replace("'", "").replace("’", "").lower()
                           for m in _CONTRACTION_RE.finditer(flat))
    breaks: frozenset[int] = frozenset()
    if _CJK_RE.search(flat):
        # where the marks cut the text, as offsets into its words run together
        at, cuts = 0, set()
        for m in _WORD_RE.finditer(flat):
            if at:
                cuts.add(at)
            at += len(m.group())
        breaks = frozenset(cuts)
    cased = []
    start = True
    for m in _CASED_RE.finditer(flat):
        tok = m.group()
        if _SENTENCE_END_RE.fullmatch(tok):
            start = True
            continue
        cased.append((tok, start))
        start = False
    return (lines, bare, marks, tuple(cased), contracted, breaks, _META_RE.search(t) is not None)


def _marks_conflict(ma: dict, mb: dict) -> bool:
    """A "?" or "!" after the same word differs, where the text that has it goes on
    inside the sentence (module docstring)."""
    for i in ma.keys() | mb.keys():
        a, b = ma.get(i, ("", False)), mb.get(i, ("", False))
        if a[0] != b[0] and (a[1] or b[1]):
            return True
    return False


def _one_case(text: str) -> bool:
    """A text written all in capitals or all in lower case."""
    letters = [ch for ch in text if ch.isalpha() and ch.lower() != ch.upper()]
    return bool(letters) and (all(ch.isupper() for ch in letters)
                              or all(ch.islower() for ch in letters))


def _case_conflict(a_cased: tuple, b_cased: tuple, a: str, b: str) -> bool:
    """A capitonym inside a sentence capitalised in one text only ("Is Turkey in
    Europe?" / "Is turkey in Europe?")."""
    if len(a_cased) != len(b_cased) or _one_case(a) or _one_case(b):
        return False
    for (ta, sa), (tb, sb) in zip(a_cased, b_cased):
        if ta == tb or sa or sb:
            continue  # a sentence's first word is capitalised for the sentence
        if ta.lower() in CAPITONYMS and ta[:1].isupper() != tb[:1].isupper():
            return True
    return False


def quotes_conflict(a: str, b: str, ordered: bool = False) -> bool:
    """Both texts quote, and their quotes differ in spacing or punctuation ('a b' /
    'ab', 'However I disagree' / 'However, I disagree'), or in case when short or a
    capitonym ('A' / 'a', 'Polish' / 'polish'), or (``ordered``) stand in another order:
    a quote is the literal subject of the question. The marks that end a quote do not
    count; quotes that differ in their words are left to the other checks."""
    if not (_QUOTE_CHAR_RE.search(a) and _QUOTE_CHAR_RE.search(b)):
        return False
    qa, qb = _quotes(a), _quotes(b)
    if not qa or not qb:
        return False
    ka, kb = [_quote_key(q) for q in qa], [_quote_key(q) for q in qb]
    if not ordered:
        ka.sort()
        kb.sort()
    if ka == kb:
        return False
    pa, pb = [_plain(q) for q in qa], [_plain(q) for q in qb]
    if not ordered:
        pa.sort()
        pb.sort()
    return pa == pb


def literal_conflict(a: str, b: str, verbatim: bool = False) -> bool:
    """Whether two texts that may read as one question differ where the spelling is the
    subject (module docstring). ``verbatim``: completion prompts."""
    if not isinstance(a, str) or not isinstance(b, str) or a == b:
        return False
    pa = _plain_of(a)
    if not pa or pa != _plain_of(b):
        # other words: only quotes that differ in their spelling alone
        return quotes_conflict(a, b)
    if verbatim:
        return a[:MAX_CHARS].lower() != b[:MAX_CHARS].lower()
    fa, fb = _form(a), _form(b)
    if fa[6] or fb[6]:
        return _BLANKS_RE.sub(" ", a[:MAX_CHARS].strip()) != _BLANKS_RE.sub(" ", b[:MAX_CHARS].strip())
    if (len(fa[0]) > 1 or len(fb[0]) > 1) and fa[0] != fb[0]:
        return True
    if _marks_conflict(fa[2], fb[2]) or quotes_conflict(a, b, ordered=True):
        return True
    if fa[5] != fb[5] and not (fa[5] <= fb[5] or fb[5] <= fa[5]):
        return True
    if (fa[4] & fb[1] | fb[4] & fa[1]) & CONTRACTED_WORDS:
        return True
    return _case_conflict(fa[3], fb[3], a, b)
