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
  "the regex ab match", "x! do" / "x? do", "5! is" / "5 is", "ab? 能匹配" (one that ends
  a sentence, "Why?! Is the sky blue" / "why is the sky blue", does not count, nor do
  commas, hyphens or quote marks: "two-factor" / "two factor", "What does 'ubiquitous'
  mean?" / "What does ubiquitous mean?");
- a mark standing alone between words must be in the other text too: "git add . do" /
  "git add do", "cd .. do" / "cd . do" ("2 + 2" / "2+2" is one question);
- the arguments of a call or an index must agree but for spaces: "print('Hi' 'there')"
  / "print('Hi', 'there')", "type((1))" / "type((1,))" (a remark in brackets after a
  space is prose: "(Deepak, Arnab)" / "(Deepak Arnab)" is one question);
- in a text that reads as code (``=``, brackets, ``$``, a call, a backquote ...), the
  quote marks and what they quote, and sigil words in their case: "{'a': 1}" / '{"a":
  1}', "name = 'NULL'" / "name = NULL", "%S" / "%s", "$HOME" / "$home" (typographic
  quotes are the plain ones);
- in Chinese, the marks must not cut the text elsewhere ("下雨天，留客天，留我不？留！" /
  "下雨天留客，天留我不留。"; "你好！" / "你好，" or a mark added, "在哪里" / "在：哪里？", is
  one question);
- quoted text must be the same and in the same order (below);
- a contraction against the word it spells without its apostrophe: "we're" / "were",
  "I'll" / "ill" (:data:`CONTRACTED_WORDS`; "what's" / "whats" and "it's" / "its",
  most often a typo, are one question);
- a capitonym inside a sentence: "Is Turkey in Europe?" / "Is turkey in Europe?", "一个
  Apple" / "一个apple" (:data:`CAPITONYMS`); other case differences are rewordings
  ("jQuery" / "JQuery", "President Obama" / "president Obama"), and a text written all
  in capitals or all in lower case (most of its letters having a case) says nothing
  about case;
- a question about the writing itself (punctuation, question marks, commas, capital
  letters, title or camel case, spelling, grammar, indentation, "is this sentence
  correct", 标点, 大写, 拼写, 语气 …) must be the same but for runs of spaces, the shapes of quote marks and the case
  of its first letter ("Fix the punctuation: hello world" / "… Hello, world!", "Does
  this need a question mark: Can you help me" / "… help me?"); one about a sentence it
  quotes ("What does this sentence mean: …", "这句话是什么意思：…") the same but for the
  marks that end it too ("无鸡鸭亦可，无鱼肉亦可" / "无鸡，鸭亦可；无鱼，肉亦可").

Quoted text (``'…'``, ``"…"``, `````…`````, ``“…”``, ``‘…’``, ``「…」``, ``『…』``; a quote
inside another is part of it), when both texts quote and the quotes hold the same words,
also when the rest of the texts differs: the quotes must agree in spacing and
punctuation ("How long is 'a b'?" / "… 'ab'?", "'However I disagree'" / "'However, I
disagree'"), and in case when a quote is short or a capitonym ("print('A' + 'b')" /
"print('a' + 'b')", "Translate 'Polish'" / "Please translate 'polish'"); in texts
otherwise the same, in any case ("'apple' or 'Banana'" / "'apple' or 'banana'"), and a
short quote in its marks too ("'a'" / '"a"': a char, a string); the marks that end a
quote do not count.

With ``verbatim`` (``/v1/completions`` prompts, whose continuation follows their last
characters), texts equal up to case, spaces and punctuation must be equal up to case
alone: "Once upon a time" / "Once upon a time " or "Roses are red," / "Roses are red."
continue differently.

:func:`code_conflict`, whatever the other words: code in backquotes and command-line
options ("docker run -d nginx" / "docker run -it nginx").

Pure functions of the two texts, cached per text; never raise on ``str`` input. None of
the labelled dev sets' pairs (16,401) is rejected by :func:`literal_conflict`, one by
:func:`code_conflict` ("KVPY 2016 SA -stream 2016?", whose numbers differ too).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import NamedTuple

from .operators import MAX_CHARS

#: Words whose capital makes another word (a nationality, a country, a month, a name).
CAPITONYMS = frozenset({
    "polish", "turkey", "china", "japan", "march", "may", "august", "mercury", "bill",
    "nice", "reading", "job", "rose", "frank", "sue", "will", "jack", "mark", "pat", "bob",
    "art", "grant", "chile", "hungary", "jersey", "guinea", "java", "python", "ruby",
    "apple", "amazon", "windows", "word", "office", "us", "who", "it", "pole", "hamlet",
    "earth", "mass", "lent", "cancer", "catholic", "democrat", "republican", "titanic",
    "phoenix", "buffalo", "mobile",
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
_MARK_RE = re.compile(rf"(?<=[A-Za-z0-9_])[?!]+(?=[ \t]*[A-Za-z0-9_(.{_CJK}])")
#: Marks standing alone between words: "git add . -A", "cd .. then" (not at the end).
_ALONE_RE = re.compile(r"(?<=\S\s)[^\w\s]+(?=\s+\S)")
_DASHES = str.maketrans("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-------")
#: What follows a mark on a word inside a sentence ("ab? match", "x! do", "5!is"), not
#: one that ends a sentence ("Why?! Is", "Hello! How").
_TIGHT_AFTER_RE = re.compile(rf"[ \t]+[a-z{_CJK}]|[A-Za-z0-9_(.]")
#: Sentence ends: the word after one starts a sentence.
_SENTENCE_END_RE = re.compile(r"[.?!。？！:;\n]")
#: Words for their case: Latin runs apart from CJK runs ("一个Apple" holds "Apple").
_CASED_RE = re.compile(r"[A-Za-z0-9]+|[^\W\dA-Za-z_]+|" + _SENTENCE_END_RE.pattern)
#: A question about writing itself: then the texts must be the same but for spaces, the
#: quote marks' shapes and the case of their first letter ("Fix the punctuation: hello
#: world" / "… Hello, world!", "Is this sentence correct: i like cats." / "… I like
#: cats.").
_META_RE = re.compile(
    r"\b(?:punctuat\w*|commas?|apostrophes?|capital letters?|capitals|capitali[sz]\w*|"
    r"upper ?case|lower ?case|spell\w*|grammar|grammatical\w*|typos?|hyphen\w*|"
    r"semicolons?|quotation\w*|whitespace|indent\w*|case[- ]sensitive|question marks?|"
    r"exclamation (?:marks?|points?)|full stops?|proofread\w*|sentence (?:is )?correct|"
    r"(?:title|sentence|camel|snake|kebab|pascal) ?case|ascii order)\b|"
    r"标点|逗号|句号|大写|小写|拼写|语法|错别字|断句|语气", re.I)
#: A question about a sentence it quotes ("What does this sentence mean: …", "这句话是什么
#: 意思：…"): the same, but the marks that end the text do not count either.
_SENTENCE_RE = re.compile(r"\b(?:this|the|following) sentence\b|这句|句子", re.I)
_META_QUOTES = str.maketrans("‘’“”", "''\"\"")
#: Arguments of a call or an index, right after a word: "print('Hi', 'there')", "a[1:]"
#: (a remark in brackets after a space is prose: its commas are a rewording).
_BRACKETS_RE = re.compile(r"(?<=[\w(\[])(?:\(([^()\n]*)\)|\[([^\[\]\n]*)\]|\{([^{}\n]*)\})")
#: Code: then quote marks, quoting and the case of quotes and of sigil words count too
#: ("{'a': 1}" / '{"a": 1}', "name = 'NULL'" / "name = NULL", "%S" / "%s").
_CODE_RE = re.compile(r"[=<>{}\[\]$;|&@^~\\]|\w\(|`|%[A-Za-z]")
_TYPOGRAPHIC = str.maketrans("‘’“”", "''\"\"")
_SIGILS = "%$@\\"
_CODE_TOKEN_RE = re.compile(r"['\"`“”‘’]|(?<!\w)[%$@\\][A-Za-z]\w*|\w+")
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
_END_MARKS_RE = re.compile(r"[\s.?!。？！…]+$")
_SPACE_RE = re.compile(r"\s+")
_BLANKS_RE = re.compile(r"[ \t]+")


def _plain(text: str) -> str:
    return _PLAIN_RE.sub("", text.lower())


@functools.lru_cache(maxsize=8192)
def _plain_of(text: str) -> str:
    return _plain(unicodedata.normalize("NFKC", text[:MAX_CHARS]))


@functools.lru_cache(maxsize=8192)
def _quotes(text: str) -> tuple[tuple[str, str], ...]:
    """The quoted spans of a text, in order, as (quote mark, text without the marks that
    end it); a quote inside another, "`echo '$HOME'`", is part of the outer one."""
    t = unicodedata.normalize("NFKC", text[:MAX_CHARS]).replace('""', '"')
    spans = sorted((m.start(), m.end(), m.group(1)) for rx in _QUOTES for m in rx.finditer(t))
    out, end = [], -1
    for start, stop, q in spans:
        if start >= end:
            out.append((t[start].translate(_TYPOGRAPHIC), _QUOTE_END_RE.sub("", q)))
            end = stop
    return tuple(out)


@functools.lru_cache(maxsize=8192)
def _code(text: str) -> tuple[bool, tuple[str, ...]]:
    """(whether the text reads as code, :data:`_CODE_RE`; its quote marks, sigil words
    as written, "$HOME", "%S", and other words lowercased, in order)."""
    t = unicodedata.normalize("NFKC", text[:MAX_CHARS]).replace('""', '"').translate(_TYPOGRAPHIC)
    toks = tuple(m if m[0] in _SIGILS or not m[0].isalnum() and m[0] != "_" else m.lower()
                 for m in _CODE_TOKEN_RE.findall(t))
    return _CODE_RE.search(t) is not None, toks


def _quote_key(q: str) -> str:
    """What two quotes must share: the text when short or a capitonym, else the text up
    to case (spaces count: 'hello  world' / 'hello world')."""
    if len(q) <= SHORT_QUOTE or q.lower() in CAPITONYMS:
        return q
    return q.lower()


class _Form(NamedTuple):
    """What :func:`literal_conflict` compares of a text cut to MAX_CHARS (module
    docstring)."""

    lines: tuple[str, ...]          # its non-blank lines, right-trimmed
    bare: frozenset[str]            # its words outside contractions, lowercased
    marks: dict[int, tuple[str, bool]]  # word index -> ("?"/"!" run after it, inside a sentence)
    cased: tuple[tuple[str, bool], ...]  # (word as written, starts a sentence)
    contracted: frozenset[str]      # its contractions without the apostrophe ("were")
    breaks: frozenset[int]          # CJK: where marks cut its words run together
    meta: int                       # 2: about writing, 1: about a sentence it quotes, 0
    alone: frozenset[str]           # marks standing alone between words
    brackets: tuple[str, ...]       # call and index arguments, spaces out


@functools.lru_cache(maxsize=8192)
def _form(text: str) -> _Form:
    """The :class:`_Form` of ``text``; cached per text."""
    t = unicodedata.normalize("NFKC", text[:MAX_CHARS]).translate(_DASHES)
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
    alone = frozenset(m.group() for m in _ALONE_RE.finditer(flat))
    brackets = tuple(_SPACE_RE.sub("", "".join(m.groups(""))) for m in _BRACKETS_RE.finditer(t))
    brackets = tuple(b if len(b) <= SHORT_QUOTE else b.lower() for b in brackets)
    meta = 2 if _META_RE.search(t) else 1 if _SENTENCE_RE.search(t) else 0
    return _Form(lines, bare, marks, tuple(cased), contracted, breaks, meta, alone, brackets)


def _written(text: str, meta: int) -> str:
    """A question about writing as it must agree (``meta`` 2: writing, 1: a sentence)."""
    t = _BLANKS_RE.sub(" ", unicodedata.normalize("NFKC", text[:MAX_CHARS]).strip())
    t = t.translate(_META_QUOTES)
    if meta == 1:
        t = _END_MARKS_RE.sub("", t)
    return t[:1].lower() + t[1:]


def _alone_missing(alone: frozenset, other: str) -> bool:
    """A mark standing alone between words of one text that the other text does not
    hold at all ("What does git add . do?" / "What does git add do?"); spaced otherwise,
    "2 + 2" / "2+2", it is the same mark."""
    if not alone:
        return False
    o = unicodedata.normalize("NFKC", other[:MAX_CHARS]).translate(_DASHES)
    return any(m not in o for m in alone)


def _marks_conflict(ma: dict, mb: dict) -> bool:
    """A "?" or "!" after the same word differs, where the text that has it goes on
    inside the sentence (module docstring)."""
    for i in ma.keys() | mb.keys():
        a, b = ma.get(i, ("", False)), mb.get(i, ("", False))
        if a[0] != b[0] and (a[1] or b[1]):
            return True
    return False


#: The pronoun "I" (also in "I'm", "I've" ...), which phone keyboards capitalise in a
#: text typed in lower case: "how do I install python".
_PRONOUN_I_RE = re.compile(r"(?<![\w'’])I(?![\w])")


def _one_case(text: str) -> bool:
    """A text written all in capitals or all in lower case (most of its letters having a
    case: a few Latin words in a Chinese text keep the case they were given; the pronoun
    "I" is left out: it stays capitalised in a text typed in lower case)."""
    letters = [ch for ch in _PRONOUN_I_RE.sub("", text[:MAX_CHARS]) if ch.isalpha()]
    cased = [ch for ch in letters if ch.lower() != ch.upper()]
    return 2 * len(cased) > len(letters) and (all(ch.isupper() for ch in cased)
                                              or all(ch.islower() for ch in cased))


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


def quotes_conflict(a: str, b: str, ordered: bool = False, exact: bool = False) -> bool:
    """Both texts quote, and their quotes differ in spacing or punctuation ('a b' /
    'ab', 'However I disagree' / 'However, I disagree'), or in case when short or a
    capitonym ('A' / 'a', 'Polish' / 'polish'; in any case with ``exact``, the texts
    otherwise the same: "'apple' or 'Banana'" / "'apple' or 'banana'"), or (``ordered``)
    stand in another order: a quote is the literal subject of the question. The marks
    that end a quote do not count; quotes that differ in their words are left to the
    other checks."""
    if not (_QUOTE_CHAR_RE.search(a) and _QUOTE_CHAR_RE.search(b)):
        return False
    qa, qb = _quotes(a), _quotes(b)
    if not qa or not qb:
        return False
    def key(mq: tuple[str, str]) -> str:
        mark, q = mq
        if not exact:
            return _quote_key(q)
        return mark + q if len(q) <= SHORT_QUOTE else q  # 'a' / "a": a char, a string

    ka, kb = [key(q) for q in qa], [key(q) for q in qb]
    if not ordered:
        ka.sort()
        kb.sort()
    if ka == kb:
        return False
    pa, pb = [_plain(q) for _, q in qa], [_plain(q) for _, q in qb]
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
    one_case = _one_case(a) or _one_case(b)  # typed all in one case: its case says nothing
    if fa.meta or fb.meta:
        meta = max(fa.meta, fb.meta)
        wa, wb = _written(a, meta), _written(b, meta)
        return wa != wb and not (one_case and wa.lower() == wb.lower())
    if (len(fa.lines) > 1 or len(fb.lines) > 1) and fa.lines != fb.lines:
        return True
    if _marks_conflict(fa.marks, fb.marks) or quotes_conflict(a, b, True, not one_case):
        return True
    (code_a, ta), (code_b, tb) = _code(a), _code(b)
    if (code_a or code_b) and ta != tb and not one_case:
        return True
    if _alone_missing(fa.alone, b) or _alone_missing(fb.alone, a):
        return True
    if fa.brackets != fb.brackets and (
            not one_case or [x.lower() for x in fa.brackets] != [x.lower() for x in fb.brackets]):
        return True
    if fa.breaks != fb.breaks and not (fa.breaks <= fb.breaks or fb.breaks <= fa.breaks):
        return True
    if (fa.contracted & fb.bare | fb.contracted & fa.bare) & CONTRACTED_WORDS:
        return True
    return _case_conflict(fa.cased, fb.cased, a, b)


_CODE_SPAN_RE = re.compile(r"`([^`\n]+)`")
#: A command-line option: "-a", "-it", "-Wall", "-name", "--rm", "--force-with-lease"
#: (not a hyphen inside a word, "e-mail", a minus before a number, "-5", nor a dash
#: before a capitalised word, "Jaish-e -Mohammad").
_FLAG_RE = re.compile(r"(?<![\w-])(?:--[A-Za-z][\w-]*|-[A-Za-z][A-Za-z0-9]{0,3}(?![\w-])|-[a-z][a-z0-9-]*)")


def _squeeze(text: str) -> str:
    return _SPACE_RE.sub(" ", text.strip())


@functools.lru_cache(maxsize=8192)
def _code_parts(text: str) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(its code spans in backquotes, spaces squeezed, sorted; its command-line options
    as written, sorted; the whole text, spaces squeezed)."""
    t = unicodedata.normalize("NFKC", text[:MAX_CHARS])
    spans = tuple(sorted(_squeeze(s) for s in _CODE_SPAN_RE.findall(t)))
    return spans, tuple(sorted(_FLAG_RE.findall(t))), _squeeze(t)


@functools.lru_cache(maxsize=8192)
def _quoted_words(text: str) -> tuple[str, ...]:
    """The words of a text's quoted spans (:func:`_quotes`), lower case, sorted (two
    single quoted words are compared: a longer quote reworded, or one in Chinese, is
    often the same question, so the other checks and the verifier judge those)."""
    return tuple(sorted(w.lower() for _, q in _quotes(text) for w in _WORD_RE.findall(q)))


def code_conflict(a: str, b: str) -> bool:
    """Whether two texts differ in the code they hold, whatever the rest of the words: a
    code span in backquotes is literal, so one text's spans must be the other's (up to
    runs of spaces: "What does `len('hello world')` return?" / "… `len('hello')` …"), or,
    when only one text has spans, stand in the other up to case ("What does `git
    status` do?" / "What does the git status command do?" is one question); the
    command-line options of the two must be the same, in their case ("docker run -d
    nginx" / "docker run -it nginx", "ls -a" / "ls -l", "-v" / "-V"); and when each
    quotes one word, it must be the same, up to case: the quote names the question's
    subject ("a comma before 'which'?" / "… before 'that'?")."""
    if not isinstance(a, str) or not isinstance(b, str) or a == b:
        return False
    (sa, fa, ta), (sb, fb, tb) = _code_parts(a), _code_parts(b)
    if fa != fb:
        return True
    qa, qb = _quoted_words(a), _quoted_words(b)
    if len(qa) == 1 and len(qb) == 1 and qa != qb and qa[0].isascii() and qb[0].isascii():
        return True
    if sa and sb:
        return sa != sb
    spans, other = (sa, tb) if sa else (sb, ta)
    other = other.lower()
    return any(s.lower() not in other for s in spans)
