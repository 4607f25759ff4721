"""Precision guard: reject a semantic candidate whose meaning likely differs from the query
even though the embeddings are close.

Small sentence embedders place "借款1万" next to "借款5万", "enable X" next to "disable X"
and "can I" next to "can't I": the words that flip the answer are few and carry little
weight in a pooled vector. The guard compares those words directly, on the query text and
the cached entry's text (the last user message of each):

- ``literal``: the same words where their spelling is the subject: lines of code and
  their indentation, words run together or split ("sun flower" / "sunflower", "its" /
  "it's"), punctuation inside the text ("x!" / "x?"), quoted text ('Polish' /
  'polish') and capitonyms; whatever the other words, code in backquotes and
  command-line options ("docker run -d" / "docker run -it") (:mod:`.literal`).
- ``numbers``: the multiset of numbers differs (Arabic digits with ``,`` thousands and
  decimals; Chinese numerals with a magnitude such as 一万 / 两千 / 五十, or followed by a
  counter such as 三个月; ``1万`` is 10000, spoken 一万五 15000; English number words,
  "thirty", "twenty-five", "two hundred"). A lone 一 (一下, 一个) or "one" (which one) is
  not a number.
- ``negation``: the texts hold different numbers of negations, one of them none or a
  second one turning the meaning again (English ``not``, ``no``, ``never``, ``n't`` ...;
  Chinese 不 / 没 / 无 / 未 / 别 / 非 / 否 / 勿, after removing A-not-A questions such as
  能不能 / 有没有 and words that do not negate such as 不错, 非常, 别人, 是否, 未来); or, in
  Chinese, a word one text negates said without negation in the other, whose own
  negation names another word (:func:`negation_moved`).
- ``antonym:<a>/<b>``: one text uses only one side of a pair (enable/disable, 借/还,
  开通/关闭, 增加/减少, ...) and the other text only the other side.
- ``order``: the two sides of a direction or comparison are swapped (重庆到西安 /
  西安到重庆, 左脸比右脸大 / 右脸比左脸大, convert pdf to word / convert word to pdf), or
  the same words stand in another order around such a marker (flights from London to
  New York / from New York to London, 5英里等于多少公里 / 5公里等于多少英里), or two
  numbers around a dash, colon, slash or "to" (a score "3-1" / "1-3", "1:3" / "3:1"); after
  ``persons``, two sides that trade places around a word that stays ("Did Germany beat
  Brazil?" / "Did Brazil beat Germany?", :func:`sides_traded`).
- ``persons``: the speaker and the addressee trade places: both texts name a first and a
  second person, in the opposite order ("Do I owe you money?" / "Do you owe me money?",
  "Can you help me?" / "Can I help you?", 你欠我钱吗 / 我欠你钱吗). A generic "you" that
  replaces "I" ("How do I reset my password?" / "How do you reset your password?") names
  only one person on each side and passes.
- ``contrast:<class>``: both texts name members of a closed class of English words, not
  the same ones (Sunday / Saturday, soft / hard yolk, small / large packages, French /
  Spanish; :mod:`.contrast`). Never overruled by the verifier.
- ``tense``, ``audience``, ``question_type``, ``actor``: past against future, another
  audience (children, students, seniors ...), what something is against how to fix it
  or why against whether, the asker acting against someone else (:mod:`.scope`).
- ``added``: one text is the other with a sentence of its own added, an instruction or
  a second request ("How do I reset my router?" / "... Be rude."; :mod:`.added`).
- ``context``: a long shared context (a document, a policy, a report) with another
  question or instruction in it: any key term that differs, or a word changed into one
  the text already holds (a key term, a member of a closed class or a side of an
  antonym pair named more often, another less often: "... 8:30 am ... 6:15 pm" /
  "... 6:15 am"). Never overruled by the verifier.
- ``key_terms``: a near-copy with one or two key terms replaced: each text has 1 or 2 key
  terms the other lacks (Chinese characters outside a function-character list such as
  皖 / 滇; English words outside a stop list such as Wisconsin / Michigan). The entity
  swap is the classic wrong hit of a semantic cache; the price is some synonym
  paraphrases (make / earn money) that are no longer served.

Per-text work (numbers, negation, antonym sides, key terms, direction pairs) is cached in
LRUs of 8192 texts: the entries' texts recur in every lookup of their namespace.
All functions are pure (no I/O) and never raise on any ``str`` input. Results are
deterministic. The effect on the labelled dev sets is measured by ``bench/cache_quality``.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from . import scope
from .added import sentence_added
from .contrast import contrast_conflict
from .contrast import member_counts as contrast_member_counts
from .literal import code_conflict, literal_conflict
from .operators import MAX_CHARS as MAX_GUARD_CHARS
from .operators import sign_conflict


@dataclass(frozen=True)
class GuardResult:
    """``ok`` True when the candidate may be served; else ``reason`` names the first check
    that failed: ``numbers`` | ``negation`` | ``antonym:<a>/<b>``. ``min_score``: a bar
    the verifier's score must reach for this pair whatever the configured threshold
    (None: the configured one)."""

    ok: bool
    reason: str | None = None
    min_score: float | None = None

    @property
    def label(self) -> str:
        """``"pass"`` (``"pass:verifier"`` for :data:`VERIFIER_DECIDES`) or
        ``"reject:<reason>"`` (the wire form of the lookup answer)."""
        if self.ok:
            return "pass" if self.reason is None else f"pass:{self.reason}"
        return f"reject:{self.reason}"


PASS = GuardResult(True, None)
VERIFIER_DECIDES = GuardResult(True, "verifier")
#: The bar of the verifier on an English substitution of other words (not another
#: spelling of the same ones): "New York City" / "New York State", "fly" / "drive",
#: "monthly" / "annual" scored 0.95-0.98, and such pairs made 3 of the 13 wrong hits of
#: qqp-en's judge part at the shipped threshold; the bar took them and 25 of its 405
#: right hits (bench/cache_quality, docs/cache.md).
SUBSTITUTION_MIN_SCORE = 0.99
VERIFIER_DECIDES_SUBSTITUTION = GuardResult(True, "verifier", SUBSTITUTION_MIN_SCORE)
"""A rejection the verifier may overrule (:func:`verifier_may_overrule`): passed on to
the verifier, label ``pass:verifier``."""

# ---------------------------------------------------------------- words and symbols

_WORD_CHAR_RE = re.compile(r"[^\W_]")


def has_words(text: str) -> bool:
    """Whether ``text`` holds a letter or a digit (of any script)."""
    return _WORD_CHAR_RE.search(text[:MAX_GUARD_CHARS]) is not None


# ---------------------------------------------------------------- numbers

_CN_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5,
              "六": 6, "七": 7, "八": 8, "九": 9}
_CN_SMALL_UNITS = {"十": 10, "百": 100, "千": 1000}
_CN_BIG_UNITS = {"万": 10_000, "亿": 100_000_000}
_CN_NUM_CHARS = "".join(_CN_DIGITS) + "".join(_CN_SMALL_UNITS) + "".join(_CN_BIG_UNITS)
_COUNTERS = "个元块月年天日期次号岁分秒周笔张倍成折件位名条家层只本种款辆台套"

# Full-width digits and separators -> ASCII, so "１０００" reads as 1000.
_FULLWIDTH = str.maketrans("０１２３４５６７８９，．％", "0123456789,.%")

# Arabic number, optionally with a Chinese magnitude right after it ("1万", "1.5亿").
_ARABIC_RE = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?\s*([万亿千百]?)")
_CN_RE = re.compile(f"[{_CN_NUM_CHARS}]+")


def _canonical(value: Decimal) -> str:
    """Canonical text of a number: ``Decimal('10000.0')`` -> ``10000``; ``3.10`` stays ``3.10``
    when it came as written (versions), only the integer part is normalised."""
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return format(value.normalize(), "f")


def _parse_cn(s: str) -> int | None:
    """Value of a Chinese numeral (一万五千 -> 15000, 三 -> 3, 十二 -> 12); None if not one.
    A single digit right after a magnitude of a hundred or more counts in the next lower
    place, as spoken: 一万五 -> 15000, 一千五 -> 1500, 三百五 -> 350, 两万三 -> 23000 (with a
    零 between, the ones: 一万零五 -> 10005)."""
    total, section, digit = 0, 0, None
    unit, zero, digits = 0, False, 0  # the last magnitude, a 零 since it, digits since it
    for ch in s:
        if ch in _CN_DIGITS:
            zero = zero or _CN_DIGITS[ch] == 0
            digits += 1
            if digit is not None:  # digit sequence read digit by digit (二零二四)
                digit = digit * 10 + _CN_DIGITS[ch]
            else:
                digit = _CN_DIGITS[ch]
        elif ch in _CN_SMALL_UNITS:
            section += (1 if digit is None else digit) * _CN_SMALL_UNITS[ch]
            digit, unit, zero, digits = None, _CN_SMALL_UNITS[ch], False, 0
        elif ch in _CN_BIG_UNITS:
            section += digit or 0
            total += (section or 1) * _CN_BIG_UNITS[ch]
            section, digit = 0, None
            unit, zero, digits = _CN_BIG_UNITS[ch], False, 0
        else:
            return None
    if digit is not None and unit >= 100 and digits == 1 and not zero:
        digit *= unit // 10
    return total + section + (digit or 0)


_EN_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_EN_TENS = {w: 10 * i for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}
_EN_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_EN_NUM_WORD = "|".join(sorted([*_EN_UNITS, *_EN_TENS, *_EN_SCALES], key=len, reverse=True))
_EN_NUM_RE = re.compile(rf"\b(?:{_EN_NUM_WORD})(?:(?:[\s-]+(?:and\s+)?)(?:{_EN_NUM_WORD}))*\b")


def _parse_en(words: list[str]) -> int:
    """The value of English number words: ["twenty", "five"] -> 25, ["two", "hundred"] ->
    200, ["three", "thousand", "four", "hundred"] -> 3400."""
    total = current = 0
    for w in words:
        if w in _EN_UNITS:
            current += _EN_UNITS[w]
        elif w in _EN_TENS:
            current += _EN_TENS[w]
        elif w == "hundred":
            current = (current or 1) * 100
        else:
            total += (current or 1) * _EN_SCALES[w]
            current = 0
    return total + current


def numbers(text: str) -> Counter[str]:
    """Multiset of the numbers written in ``text``, as canonical strings.

    ``"借款1万"`` -> ``{"10000": 1}``; ``"10,000 and 3.10"`` -> ``{"10000", "3.10"}``;
    ``"三个月"`` -> ``{"3"}``; ``"查一下"`` -> ``{}``; English number words too:
    ``"after thirty days"`` -> ``{"30"}``, ``"twenty-five"`` -> ``{"25"}`` (a lone "one"
    is no number: "which one")."""
    text = text[:MAX_GUARD_CHARS].translate(_FULLWIDTH)
    found: Counter[str] = Counter()
    spans: list[tuple[int, int]] = []
    for m in _ARABIC_RE.finditer(text):
        whole, frac, unit = m.group(1), m.group(2) or "", m.group(3)
        digits = whole.replace(",", "")
        try:
            if unit:
                value = Decimal(digits + frac) * (_CN_BIG_UNITS.get(unit)
                                                  or _CN_SMALL_UNITS[unit])
                found[_canonical(value)] += 1
            elif frac:
                found[f"{int(digits)}{frac}"] += 1  # keep "3.10" apart from "3.1"
            else:
                found[str(int(digits))] += 1
        except (InvalidOperation, ValueError):
            continue
        spans.append(m.span())
    for m in _CN_RE.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue
        s = m.group(0)
        has_unit = any(c in _CN_SMALL_UNITS or c in _CN_BIG_UNITS for c in s)
        nxt = text[m.end():m.end() + 1]
        if not any(c in _CN_DIGITS for c in s):
            continue  # 百度, 千万 (by all means), 十分 (very): a magnitude alone is a word
        if s in ("一", "〇", "零") and not has_unit:
            continue  # 一下 / 一个 / 统一: not a quantity worth comparing
        if not has_unit and nxt not in _COUNTERS and len(s) < 2:
            continue  # a lone digit character inside a word (三星, 五花肉)
        value = _parse_cn(s)
        if value is not None:
            found[str(value)] += 1
    for m in _EN_NUM_RE.finditer(text.lower()):
        words = [w for w in re.split(r"[\s-]+", m.group(0)) if w != "and"]
        if words == ["one"]:
            continue  # "which one", "one of": a pronoun more often than a quantity
        found[str(_parse_en(words))] += 1
    return found


# ---------------------------------------------------------------- negation

_EN_WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)?")
# and the adverbs that turn a statement almost into its negation ("I can hardly log
# in", "my app rarely crashes"): the embedding and the verifier read them as the same
# question without them
_EN_NEGATIONS = frozenset({
    "not", "no", "never", "cannot", "without", "nor", "neither", "none", "nothing",
    "nobody", "nowhere", "unable", "hardly", "barely", "scarcely", "rarely", "seldom",
})
_EN_NT_RE = re.compile(r"n't\b|n’t\b")

# Words containing a negation character that do not negate the sentence, and A-not-A
# questions (能不能 = 能吗), removed before looking for Chinese negations.
_ZH_NOT_NEGATING = (
    "不错", "不过", "不少", "不管", "差不多", "不久", "不断", "不仅", "不但", "不一定",
    "非常", "除非", "是非", "别人", "区别", "特别", "分别", "类别", "级别", "差别",
    "识别", "性别", "告别", "辨别", "个别", "鉴别", "是否", "否则", "未来", "无论",
    "并非", "莫名", "不好意思",
)
_ZH_A_NOT_A_RE = re.compile(r"(.)[不没]\1")
_ZH_NEGATIONS = "不没无未别非否勿莫"


@functools.lru_cache(maxsize=8192)
def numbers_key(text: str) -> frozenset[tuple[str, int]]:
    """:func:`numbers` as a hashable value (two texts' numbers differ when their keys
    differ); cached per text."""
    return frozenset(numbers(text).items())


@functools.lru_cache(maxsize=8192)
def negated(text: str) -> bool:
    """True when ``text`` contains a negation (English or Chinese), see module doc."""
    return negations(text) > 0


@functools.lru_cache(maxsize=8192)
def negations(text: str) -> int:
    """How many negations ``text`` holds (English words and n't, Chinese characters after
    the words that do not negate): a second one turns the meaning again, so the guard
    compares the counts ("为什么不能不交年费" / "为什么不能交年费", "Why can't I log in if I
    didn't change my password?" / "... if I changed ...")."""
    t = text[:MAX_GUARD_CHARS].lower().replace("’", "'")
    n = len(_EN_NT_RE.findall(t))
    n += sum(1 for w in _EN_WORD_RE.findall(t) if w in _EN_NEGATIONS)
    z = _ZH_A_NOT_A_RE.sub(r"\1", t)
    for w in _ZH_NOT_NEGATING:
        z = z.replace(w, "")
    return n + sum(z.count(c) for c in _ZH_NEGATIONS)


_ZH_CJK2_RE = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]{2}")
#: Where a Chinese clause ends: a mark, or a conjunction that starts another (但, 可是 ...).
_ZH_CLAUSE_RE = re.compile(r"[\s,.;:?!，。；：？！、]+|但是|但|可是|却|而且|而")


@functools.lru_cache(maxsize=8192)
def _zh_negated(text: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """(the two characters each Chinese negation applies to, 没收到 -> 收到, 没有收到 ->
    收到, a negation with nothing after it naming none; the clauses without a negation),
    read as :func:`negations` reads the text: A-not-A questions and the words that do not
    negate taken out."""
    z = _ZH_A_NOT_A_RE.sub(r"\1", text[:MAX_GUARD_CHARS])
    for w in _ZH_NOT_NEGATING:
        z = z.replace(w, "")
    out = set()
    for i, ch in enumerate(z):
        if ch in _ZH_NEGATIONS:
            j = i + 2 if ch == "没" and z[i + 1:i + 2] == "有" else i + 1
            m = _ZH_CJK2_RE.match(z, j)
            if m:
                out.add(m.group())
    plain = tuple(c for c in _ZH_CLAUSE_RE.split(z)
                  if c and not any(n in c for n in _ZH_NEGATIONS))
    return frozenset(out), plain


def negation_moved(query: str, candidate: str) -> bool:
    """Chinese: a word one text negates stands in a clause without any negation in the
    other, whose own negation names another word ("我没收到退款怎么办" /
    "我收到退款了但金额不对怎么办": one negation each, so :func:`negations` counts them
    equal). A negation with nothing named after it (而我没有) may stand for the word, and a
    clause holding a negation anywhere may negate it (微粒贷怎么没显示), so neither counts.
    A Chinese negation stands right before what it negates; English word order moves it
    ("Why doesn't my phone charge?" / "Why is my phone not charging?"), so English is left
    to the count."""
    if _CJK_RE.search(query[:MAX_GUARD_CHARS]) is None or \
            _CJK_RE.search(candidate[:MAX_GUARD_CHARS]) is None:
        return False
    (nq, pq), (nc, pc) = _zh_negated(query), _zh_negated(candidate)

    def moved(neg: frozenset[str], other_neg: frozenset[str], plain: tuple[str, ...]) -> bool:
        return bool(other_neg) and any(
            w not in other_neg and any(w in c for c in plain) for w in neg)

    return moved(nq, nc, pc) or moved(nc, nq, pq)


#: Words whose place decides what they negate or restrict.
_SCOPE_WORDS = frozenset({"not", "no", "never", "only", "without", "nor"})
#: Words that join two clauses or conditions: a scope word moved across one of them
#: negates or restricts the other one.
_CLAUSE_JOINTS = frozenset({"and", "but", "or", "nor", "while", "whereas", "yet", "although",
                            "though", "except", "unless"})
_NT_RE = re.compile(r"n't\b")
_CANNOT_RE = re.compile(r"\bcannot\b")
_SCOPE_TOKEN_RE = re.compile(r"[^\W_]+|[.,;:!?]")
_CLAUSE_END = frozenset(".,;:!?")
#: Joints of a list ("red and blue", "cash or card"), which a trailing "only" covers whole.
_LIST_JOINTS = frozenset({"and", "or"})


@functools.lru_cache(maxsize=8192)
def _scope_marks(text: str) -> tuple[tuple[str, ...], frozenset[int]]:
    """The words of ``text`` for :func:`negation_word_moved` and the places of those that
    end a clause (a punctuation mark or the end of the text follows)."""
    t = text[:MAX_GUARD_CHARS].lower().replace("\u2019", "'")
    words: list[str] = []
    ends: set[int] = set()
    for w in _SCOPE_TOKEN_RE.findall(_CANNOT_RE.sub("can not", _NT_RE.sub(" not", t))):
        if w in _CLAUSE_END:
            if words:
                ends.add(len(words) - 1)
        else:
            words.append(w)
    if words:
        ends.add(len(words) - 1)
    return tuple(words), frozenset(ends)


def _only_around_list(a: tuple[str, ...], b: tuple[str, ...], lo: int, hi: int,
                      b_ends: frozenset[int]) -> bool:
    """Whether ``b`` ends a clause with the "only" that ``a`` puts before the same words
    (``a[lo]`` moved to ``b[hi - 1]``), the words between holding a list joined by "and"
    or "or" that neither starts nor ends with its joint: "We ship to the US and Canada
    only." / "We only ship to the US and Canada.", "Respond with yes or no only." /
    "Respond only with yes or no.", where the "only" covers the whole list either way."""
    span = a[lo + 1:hi]
    return (a[lo] == "only" and b[hi - 1] == "only" and span == b[lo:hi - 1]
            and hi - 1 in b_ends and bool(span)
            and span[0] not in _CLAUSE_JOINTS and span[-1] not in _CLAUSE_JOINTS
            and all(w in _LIST_JOINTS for w in span if w in _CLAUSE_JOINTS))


def negation_word_moved(query: str, candidate: str) -> bool:
    """The same words, a negation or "only" moved across a word that joins two clauses or
    conditions (and, but, or, while ...): "Cats are allowed but dogs are not allowed" /
    "Cats are not allowed but dogs are allowed", "recommended for adults but not for
    infants" / "recommended not for adults but for infants", ``if a and not b`` / ``if not
    a and b``. :func:`negations` counts them equal, and the embedding and the verifier see
    the same words (cosine 0.997-0.999, verifier 0.955-0.996). "n't" reads as "not"; a
    move inside one clause is left to the verifier, as English places them freely there
    ("Why doesn't the app open?" / "Why does the app not open?", "I only want to see the
    totals" / "I want to see only the totals"), and so is a text with other words too,
    and an "only" that moves from before a list joined by "and" or "or" to the end of its
    clause ("for members and guests only" / "only for members and guests"), which
    restricts the same list (:func:`_only_around_list`); one put inside the list ("for
    members only and guests") is a move."""
    (a, a_ends), (b, b_ends) = _scope_marks(query), _scope_marks(candidate)
    if a == b or Counter(a) != Counter(b):
        return False
    if [w for w in a if w not in _SCOPE_WORDS] != [w for w in b if w not in _SCOPE_WORDS]:
        return False
    lo, hi = 0, len(a)
    while a[lo] == b[lo]:
        lo += 1
    while a[hi - 1] == b[hi - 1]:
        hi -= 1
    if _only_around_list(a, b, lo, hi, b_ends) or _only_around_list(b, a, lo, hi, a_ends):
        return False
    return any(w in _CLAUSE_JOINTS for w in a[lo:hi])


# ---------------------------------------------------------------- antonyms

#: (name, side A words, side B words). English words match whole words (lowercased);
#: Chinese words match as substrings.
ANTONYMS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("enable/disable", ("enable", "enabled", "enabling", "activate", "activated", "turn on",
                        "switch on"),
     ("disable", "disabled", "disabling", "deactivate", "deactivated", "turn off",
      "switch off")),
    ("lock/unlock", ("lock", "locked"), ("unlock", "unlocked")),
    ("install/uninstall", ("install", "installed", "installing"),
     ("uninstall", "uninstalled", "uninstalling", "remove")),
    ("subscribe/unsubscribe", ("subscribe", "subscribed"), ("unsubscribe", "unsubscribed")),
    ("encrypt/decrypt", ("encrypt", "encrypted", "encryption"),
     ("decrypt", "decrypted", "decryption")),
    ("connect/disconnect", ("connect", "connected"), ("disconnect", "disconnected")),
    ("increase/decrease", ("increase", "increased", "raise", "more"),
     ("decrease", "decreased", "reduce", "lower", "less", "fewer")),
    ("upload/download", ("upload", "uploaded"), ("download", "downloaded")),
    ("import/export", ("import", "imported"), ("export", "exported")),
    ("buy/sell", ("buy", "buying", "bought", "purchase"), ("sell", "selling", "sold")),
    ("login/logout", ("login", "log in", "sign in", "signin"),
     ("logout", "log out", "sign out", "signout")),
    ("show/hide", ("show", "unhide"), ("hide", "hidden")),
    ("before/after", ("before",), ("after",)),
    ("above/below", ("above",), ("below",)),
    ("max/min", ("max", "maximum", "most", "highest", "best"),
     ("min", "minimum", "least", "lowest", "worst")),
    ("true/false", ("true", "valid", "legal", "possible"),
     ("false", "invalid", "illegal", "impossible")),
    ("借/还", ("借",), ("还款", "还钱", "归还", "偿还", "还清", "还贷")),
    ("存/取", ("存款", "存入", "存钱"), ("取款", "取钱", "取出", "提现")),
    ("开通/关闭", ("开通", "开启", "打开", "启用", "激活", "绑定", "注册", "申请"),
     ("关闭", "停用", "注销", "解绑", "解除", "取消")),
    ("增加/减少", ("增加", "提高", "提升", "上调", "调高", "增大"),
     ("减少", "降低", "下调", "调低", "减小")),
    ("转入/转出", ("转入",), ("转出",)),
    ("收入/支出", ("收入",), ("支出",)),
    ("买/卖", ("买入", "购买"), ("卖出", "出售")),
    ("最高/最低", ("最高", "最多", "最大", "最长"), ("最低", "最少", "最小", "最短")),
    ("以上/以下", ("以上",), ("以下",)),
    ("之前/之后", ("之前", "以前"), ("之后", "以后")),
    ("登录/退出", ("登录", "登陆"), ("退出", "登出")),
    ("提前/逾期", ("提前",), ("逾期", "延期")),
    ("成功/失败", ("成功",), ("失败",)),
    ("男/女", ("男",), ("女",)),
)


@dataclass(frozen=True)
class _AntonymIndex:
    """:data:`ANTONYMS` indexed for one pass over a text. A slot is ``2 * pair + side``
    (side 0 = A, 1 = B). Matching rules: a single English word is a word of the text, an
    English phrase matches ``\\b``-bounded, any other string (Chinese) as a substring."""

    words: dict[str, tuple[int, ...]]
    phrases: tuple[tuple[str, re.Pattern[str], int], ...]
    others: tuple[tuple[str, int], ...]


@functools.lru_cache(maxsize=1)
def _antonym_index() -> _AntonymIndex:
    words: dict[str, list[int]] = {}
    phrases: list[tuple[str, re.Pattern[str], int]] = []
    others: list[tuple[str, int]] = []
    for i, (_, a, b) in enumerate(ANTONYMS):
        for side, items in enumerate((a, b)):
            slot = 2 * i + side
            for w in items:
                if not w.isascii():
                    others.append((w, slot))
                elif " " in w:
                    phrases.append((w, re.compile(rf"\b{re.escape(w)}\b"), slot))
                else:
                    words.setdefault(w, []).append(slot)
    return _AntonymIndex({w: tuple(v) for w, v in words.items()}, tuple(phrases),
                         tuple(others))


@functools.lru_cache(maxsize=8192)
def _antonym_sides(text: str) -> tuple[bool, ...]:
    """Per slot of :class:`_AntonymIndex` (pair ``i``: slots ``2i`` and ``2i + 1``), whether
    ``text`` uses that side; cached (cache entries' texts recur in every lookup of their
    namespace)."""
    idx = _antonym_index()
    t = text[:MAX_GUARD_CHARS].lower()
    used = [False] * (2 * len(ANTONYMS))
    for w in set(_EN_WORD_RE.findall(t)):
        for slot in idx.words.get(w, ()):
            used[slot] = True
    for phrase, rx, slot in idx.phrases:
        if not used[slot] and phrase in t and rx.search(t) is not None:
            used[slot] = True
    if not t.isascii():  # the other strings are all non-ASCII
        for w, slot in idx.others:
            if not used[slot] and w in t:
                used[slot] = True
    return tuple(used)


def antonym_conflict(query: str, candidate: str) -> str | None:
    """Name of the first antonym pair the two texts use on opposite sides, else None.

    A conflict needs one text to use only side A and the other only side B: "enable X" vs
    "disable X" conflicts; "enable X" vs "turn X on" (same side), "enable X" vs "X settings"
    (pair unused) and "enable X" vs "enable or disable X" (both sides) do not."""
    uq, uc = _antonym_sides(query), _antonym_sides(candidate)
    if uq == uc:
        return None
    for i, (name, _, _) in enumerate(ANTONYMS):
        qa, qb, ca, cb = uq[2 * i], uq[2 * i + 1], uc[2 * i], uc[2 * i + 1]
        if qa != qb and ca != cb and qa != ca:  # each uses one side only, not the same
            return name
    return None


# ---------------------------------------------------------------- Chinese key characters

_CJK_RE = re.compile(r"[\u4e00-\u9fff]")
#: Characters that carry no topic: particles, pronouns, question words, copulas, common
#: verbs of asking. What is left are the key characters (the things asked about).
_ZH_FUNCTION = frozenset(
    "的了吗呢啊吧呀么嘛哦哈是在有和与或及也都就还又很太最更请问您你我他她它们这那哪个些"
    "什怎样如何为啥谁几多少能可以会要想把被给让对于从到向往比跟同等之其此所着过得地"
    "一下里上中吗么啦喔嗯呐哇")
KEY_CHAR_MAX = 2
"""A substitution of at most this many key terms on each side is a different question
(皖/滇, 左/右, Wisconsin/Michigan); a longer rewording is left to the threshold."""

_EN_STOP = frozenset("""
a about above after again all also am an and any are as at be been being both but by can
could did do does doing done during each else ever for from get gets getting got had has
have having he her here hers him his how i if in into is it its itself just let lets me
might more most much must my myself no nor not now of off on once one only or other our
ours out over own per please really same shall she should so some such than that the
their theirs them then there these they thing things this those through to too under
until up upon us very was way ways we were what whats when where whether which while who
whom whose why will with without would yet you your yours yourself anyone someone
something anything everything people person
""".split())


def _stem(w: str) -> str:
    """Crude English suffix stripping, enough to match funded/funding, indians/indian."""
    w = w.split("'")[0]
    for suf in ("ing", "ed", "es", "ly", "s"):
        if len(w) > len(suf) + 3 and w.endswith(suf):
            return w[: -len(suf)]
    return w


def _antonym_words() -> frozenset[str]:
    return frozenset(w for _, a, b in ANTONYMS for phrase in a + b if phrase.isascii()
                     for w in phrase.split())


_ANTONYM_WORDS = _antonym_words()


def key_terms(text: str) -> set[str]:
    """Key terms of ``text``: Chinese characters outside the function list, and English
    words outside a stop list (crudely stemmed). Words of the antonym pairs are left to
    the antonym check (so "enable" / "turn on" is no substitution); digits to the number
    check."""
    return set(_key_terms(text))


#: Chinese words that name one key term in several spellings: each group's words are
#: read as its first before key terms are compared, so a rewording with one of them
#: ("重设密码" / "重置密码": reset) is no substitution. Only exchangeable words: every
#: pair here asks the same question in a customer-service or everyday setting. Curated by
#: hand from common usage (everyday words a speaker exchanges in a question), not mined
#: from the dev data; the effect on the judge part of the dev data is measured through
#: ``bench/cache_quality`` (docs/cache.md "What it serves").
#: Groups of words that are not the same question (没吃 / 不吃, 吃 / 喝) stay out.
ZH_SYNONYMS: tuple[tuple[str, ...], ...] = (
    ("重置", "重设", "重新设置"), ("修改", "更改", "变更", "更换", "改变"),
    ("登录", "登陆", "登入"), ("账户", "帐户", "账号", "帐号"), ("账", "帐"),
    ("注销", "注消", "销户"), ("取消", "撤销", "撤消", "解除", "关闭"),
    ("图片", "照片", "相片"),
    ("提现", "取现"), ("多久", "多长时间", "多少时间"), ("何时", "什么时候", "啥时候"),
    ("哪里", "哪儿", "什么地方", "啥地方"), ("立即", "立刻", "马上"),
    ("现在", "目前", "当前"), ("类似", "相似", "像"), ("相同", "一样"),
    ("女友", "女朋友"), ("男友", "男朋友"), ("妻子", "老婆"), ("丈夫", "老公"),
    ("电脑", "计算机"), ("手机号", "手机号码", "电话号码"), ("钱", "款"),
    ("为什么", "为啥", "为何"), ("能否", "可否", "是否可以"), ("审核", "审批"),
    # everyday wordings: loans, how / what to do, ways, often, prices, early, days,
    # restaurants, raising, screenshots, getting, what / which
    ("借款", "贷款", "借钱"), ("怎么办", "怎么处理", "如何处理", "咋办"),
    ("怎么", "如何", "怎样", "咋"), ("方法", "办法", "方式"),
    ("经常", "常常", "总是", "老是"), ("价格", "价钱", "多少钱", "售价"),
    ("提前", "提早"), ("今天", "今日"), ("明天", "明日"), ("昨天", "昨日"),
    ("餐厅", "饭店", "饭馆", "餐馆"), ("提高", "提升", "调高"), ("截图", "截屏"),
    ("获得", "获取", "得到", "领取"), ("什么", "哪些", "啥"),
)


def _zh_synonym_map() -> tuple[re.Pattern[str], dict[str, str]]:
    to = {w: g[0] for g in ZH_SYNONYMS for w in g}
    words = sorted(to, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, words))), to


_ZH_SYN_RE, _ZH_SYN = _zh_synonym_map()


def zh_canonical(text: str) -> str:
    """``text`` with the words of :data:`ZH_SYNONYMS` replaced by the first of their
    group (longest match first)."""
    return _ZH_SYN_RE.sub(lambda m: _ZH_SYN[m.group(0)], text)


@functools.lru_cache(maxsize=8192)
def _key_terms(text: str) -> frozenset[str]:
    t = text[:MAX_GUARD_CHARS]
    zh = {c for c in _CJK_RE.findall(t) if c not in _ZH_FUNCTION}
    en = {_stem(w) for w in _EN_WORD_RE.findall(t.lower())
          if w not in _EN_STOP and w not in _ANTONYM_WORDS}
    return frozenset(zh | {w for w in en if w and w not in _EN_STOP})


def key_chars(text: str) -> set[str]:
    """Chinese key characters of ``text`` (see :func:`key_terms`)."""
    return {c for c in _CJK_RE.findall(text[:MAX_GUARD_CHARS]) if c not in _ZH_FUNCTION}


def _substituted(q: frozenset[str] | set[str], c: frozenset[str] | set[str]) -> bool:
    only_q, only_c = q - c, c - q
    return 0 < len(only_q) <= KEY_CHAR_MAX and 0 < len(only_c) <= KEY_CHAR_MAX


@functools.lru_cache(maxsize=8192)
def _canonical_terms(text: str) -> frozenset[str]:
    return _key_terms(zh_canonical(text[:MAX_GUARD_CHARS]))


def key_term_substitution(query: str, candidate: str) -> bool:
    """True when each text has 1..KEY_CHAR_MAX key terms the other lacks: a near-copy with
    a word swapped for another ("皖是哪个省会的简称" / "滇是哪个省会的简称", "shotgun rules
    in Wisconsin" / "shotgun rules in Michigan"), both as written and with the words of
    :data:`ZH_SYNONYMS` read as one (so "重设密码" / "重置密码" is no substitution).
    Pure additions or removals ("小孔雀鱼" / "孔雀鱼") and longer rewordings are not
    flagged."""
    if not _substituted(_key_terms(query), _key_terms(candidate)):
        return False
    return _substituted(_canonical_terms(query), _canonical_terms(candidate))


#: Two key terms at least this alike (difflib ratio) are one word spelled two ways.
SPELLING_RATIO = 0.8


def _spelled_alike(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a) \
        or difflib.SequenceMatcher(None, a, b).ratio() >= SPELLING_RATIO


def spelling_variant(query: str, candidate: str) -> bool:
    """True when the key terms the two texts do not share are the same words spelled
    otherwise: each has a look-alike on the other side (a typo, "analytics" /
    "analyticis"; an inflection the stemmer missed) or one side's terms written together
    are the other's ("mindblowing" / "mind blowing"). Such a substitution is no other
    question; a substitution of other words may be one ("city" / "state")."""
    a, b = _canonical_terms(query), _canonical_terms(candidate)
    only_a, only_b = a - b, b - a
    if not only_a or not only_b:
        return not only_a and not only_b
    if all(any(_spelled_alike(x, y) for y in only_b) for x in only_a) \
            and all(any(_spelled_alike(y, x) for x in only_a) for y in only_b):
        return True
    small, large = sorted((only_a, only_b), key=len)
    if len(small) != 1 or len(large) > KEY_CHAR_MAX + 1:
        return False
    one = next(iter(small))
    return any("".join(p) in one or one in "".join(p)
               for p in itertools.permutations(large))


#: An English question that asks for an amount: how many / much / long ..., or "what is
#: the number / population / price ... of".
_QUANTITY_RE = re.compile(
    r"\bhow (?:many|much|long|far|old|big|tall|often|large|fast)\b|\bwhat(?:'s| is| are| was)"
    r" the (?:number|population|price|cost|size|rate|percentage|average|total|gdp|salary"
    r"|height|weight|length|distance|age|amount|value|speed|area)\b", re.IGNORECASE)


def qualifier_added(query: str, candidate: str) -> bool:
    """True when one English text asks for an amount and the other is the same question
    with 1..KEY_CHAR_MAX key terms added ("How many students attend Harvard?" / "How many
    undergraduate students ...", "the GDP" / "the GDP per capita"): the added words
    narrow what is counted, so the answer differs, while the verifier scored such pairs
    0.96. A pure addition elsewhere is left to the verifier's threshold."""
    if _CJK_RE.search(query[:MAX_GUARD_CHARS]) or _CJK_RE.search(candidate[:MAX_GUARD_CHARS]):
        return False
    if not (_QUANTITY_RE.search(query[:MAX_GUARD_CHARS])
            or _QUANTITY_RE.search(candidate[:MAX_GUARD_CHARS])):
        return False
    a, b = _canonical_terms(query), _canonical_terms(candidate)
    extra = (a - b) if b < a else (b - a) if a < b else set()
    return 0 < len(extra) <= KEY_CHAR_MAX


def key_char_substitution(query: str, candidate: str) -> bool:
    """:func:`key_term_substitution` on Chinese key characters only."""
    if not _substituted(key_chars(query), key_chars(candidate)):
        return False
    return _substituted(key_chars(zh_canonical(query[:MAX_GUARD_CHARS])),
                        key_chars(zh_canonical(candidate[:MAX_GUARD_CHARS])))


_ZH_DIRECTION = "到比转"
_EN_DIRECTION = frozenset({"to", "into", "than", "vs", "versus"})
_EN_SKIP = frozenset({"a", "an", "the", "my", "your", "from", "of"})


@functools.lru_cache(maxsize=8192)
def _zh_pairs(text: str) -> frozenset[tuple[str, str]]:
    t = "".join(c for c in text[:MAX_GUARD_CHARS] if _CJK_RE.match(c)
                and (c not in _ZH_FUNCTION or c in _ZH_DIRECTION))
    out = set()
    for i, ch in enumerate(t):
        if ch in _ZH_DIRECTION and i >= 2 and i + 2 < len(t) + 0:
            out.add((t[i - 2:i], t[i + 1:i + 3]))
    return frozenset(out)


@functools.lru_cache(maxsize=8192)
def _en_pairs(text: str) -> frozenset[tuple[str, str]]:
    words = [w for w in _EN_WORD_RE.findall(text[:MAX_GUARD_CHARS].lower())
             if w not in _EN_SKIP]
    return frozenset((words[i - 1], words[i + 1]) for i, w in enumerate(words)
                     if w in _EN_DIRECTION and 0 < i < len(words) - 1)


# Two numbers joined by a dash, colon, slash or "to": a score, ratio, range or vote
# ("3-1", "1:3", "18-65", "9 to 3"), whose order is its meaning. Overlapping, so a date's
# parts pair up in turn ("2024-03-05": 2024-3, 3-5).
_NUM_PAIR_RE = re.compile(r"(?<![\d.,])(?=(\d+(?:\.\d+)?)\s*(?:[-\u2013:/]|\s(?:to)\s)\s*"
                          r"(\d+(?:\.\d+)?)(?![\d]))", re.IGNORECASE)


@functools.lru_cache(maxsize=8192)
def _num_pairs(text: str) -> frozenset[tuple[str, str]]:
    t = text[:MAX_GUARD_CHARS].translate(_FULLWIDTH)
    return frozenset((_canonical(Decimal(a)), _canonical(Decimal(b)))
                     for a, b in _NUM_PAIR_RE.findall(t))


# Words (a CJK character is one) for the reordering check; direction and comparison
# markers among them.
_ORDER_TOKEN_RE = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]|(?:(?![\u3400-\u9fff\uf900-\ufaff])[^\W_])+")
_ORDER_MARKERS = frozenset({"to", "into", "than", "vs", "versus", "到", "比", "转", "等"})


@functools.lru_cache(maxsize=8192)
def _order_tokens(text: str) -> tuple[str, ...]:
    return tuple(_ORDER_TOKEN_RE.findall(text[:MAX_GUARD_CHARS].lower()))


#: Words that join two sides which may trade places without changing the question:
#: "TCP and UDP" / "UDP and TCP", 苹果和香蕉 / 香蕉和苹果, 又胖又矮 / 又矮又胖, A好还是B好.
_JOINTS = frozenset({"and", "or", "nor", "和", "与", "跟", "及", "或", "同", "又", "还"})
#: Longest run of differing words :func:`_sides_traded` looks at.
_TRADE_MAX = 32


def _trades(x: tuple[str, ...], y: tuple[str, ...],
            strict: bool = False) -> tuple[bool, bool]:
    """For two runs of words of one length: (whether ``y`` is ``x`` with two parts
    trading places around a third, X M Y / Y M X, M holding no joint word; whether it is
    ``x`` reordered harmlessly: two parts that trade places with nothing between them, or
    around a joint word, with ``strict`` a joint word alone)."""
    n, hard, soft = len(x), False, False
    for j in range(1, n):
        if y[:j] != x[n - j:]:      # y starts with x's last j words
            continue
        if y[j:] == x[:n - j]:
            soft = True
        for i in range(1, n - j):
            if x[:i] == x[n - j:] or y[n - i:] != x[:i] or y[j:n - i] != x[i:n - j]:
                continue
            mid = x[i:n - j]
            if any(t in _JOINTS for t in mid):
                soft = soft or not strict or (len(mid) == 1 and mid[0] in _JOINTS)
            else:
                hard = True
    return hard, soft


def _trade_kinds(tq: tuple[str, ...], tc: tuple[str, ...],
                 strict: bool = False) -> tuple[bool, bool]:
    """For ``tc``, ``tq`` with its words in another order: (whether two runs of words
    trade places around a third that stays, :func:`_trades`; whether some reading of the
    change is a harmless one: a block moved as a whole, "To bake bread, what flour ...?" /
    "What flour ... to bake bread?", or two sides trading places around a joint word,
    "rent or buy" / "buy or rent"; with ``strict`` the joint word alone between them,
    not "第十名和1968年的第八名" / "第八名和1968年的第十名"). The words the texts share before and after the part
    that differs may belong to the parts ("运动鞋和休闲鞋有什么区别" / "休闲鞋和运动鞋…"). A
    part longer than :data:`_TRADE_MAX` words is read as neither."""
    lo = 0
    while lo < len(tq) and lo < len(tc) and tq[lo] == tc[lo]:
        lo += 1
    hq, hc = len(tq), len(tc)
    while hq > lo and hc > lo and tq[hq - 1] == tc[hc - 1]:
        hq, hc = hq - 1, hc - 1
    if hq - lo != hc - lo or hq - lo < 2 or hq - lo > _TRADE_MAX:
        return False, False
    hard = False
    for a in range(lo, max(-1, lo - 6), -1):
        for b in range(hq, min(len(tq), hq + 6) + 1):
            if b - a > _TRADE_MAX:
                break
            h, soft = _trades(tq[a:b], tc[a:b], strict)
            if soft:
                return hard or h, True
            hard = hard or h
    return hard, False


def _sides_traded(tq: tuple[str, ...], tc: tuple[str, ...]) -> bool:
    """Whether ``tc`` is ``tq`` with two runs of words trading places around a third that
    stays ("Did Germany beat Brazil" / "Did Brazil beat Germany", "Celsius in
    Fahrenheit" / "Fahrenheit in Celsius", 张翰喜欢郑爽吗 / 郑爽喜欢张翰吗), and no reading
    of the change as a harmless one (:func:`_trade_kinds`)."""
    hard, soft = _trade_kinds(tq, tc)
    return hard and not soft


def swapped(query: str, candidate: str) -> bool:
    """True when the two sides of a direction or comparison are swapped: "重庆到西安" /
    "西安到重庆", "左脸比右脸大" / "右脸比左脸大", "convert pdf to word" / "convert word to pdf";
    also when the two texts hold the same words in another order around such a marker,
    whatever the sides are made of ("flights from London to New York" / "from New York to
    London", "Is Bob taller than Alice?" / "Is Alice taller than Bob?", "5英里等于多少公里" /
    "5公里等于多少英里"); and two numbers that trade places around a dash, colon, slash or
    "to" (a score "3-1" / "1-3", a ratio "1:3" / "3:1", a range, a vote "9 to 3" / "3 to
    9", a date's day and month), which the multiset of numbers does not see."""
    for pairs in (_zh_pairs, _en_pairs, _num_pairs):
        pq, pc = pairs(query), pairs(candidate)
        if any((b, a) in pc and a != b and (a, b) not in pc for a, b in pq):
            return True
    tq, tc = _order_tokens(query), _order_tokens(candidate)
    return (len(tq) >= 2 and tq != tc and any(t in _ORDER_MARKERS for t in tq)
            and Counter(tq) == Counter(tc) and not _trade_kinds(tq, tc, True)[1])


def sides_traded(query: str, candidate: str) -> bool:
    """True when two runs of the same words trade places around a third that stays
    (:func:`_sides_traded`: "Did Germany beat Brazil?" / "Did Brazil beat Germany?",
    "30 degrees Celsius in Fahrenheit" / "30 degrees Fahrenheit in Celsius")."""
    tq, tc = _order_tokens(query), _order_tokens(candidate)
    return tq != tc and Counter(tq) == Counter(tc) and _sides_traded(tq, tc)


_EN_FIRST = frozenset({"i", "me", "my", "mine", "myself", "we", "us", "our", "ours",
                       "ourselves", "i'm", "i've", "i'll", "i'd", "we're", "we've", "we'll",
                       "we'd"})
_EN_SECOND = frozenset({"you", "your", "yours", "yourself", "yourselves", "you're",
                        "you've", "you'll", "you'd"})
_PERSON_RE = re.compile(r"[a-z]+(?:'[a-z]+)?|[\u6211\u4f60\u60a8]")
_ZH_PERSON = {"\u6211": 1, "\u4f60": 2, "\u60a8": 2}  # 我, 你, 您
# greetings that name no addressee: 你好, 您好, 你们好
_ZH_GREETING_RE = re.compile(r"[\u4f60\u60a8]\u4eec?\u597d")


@functools.lru_cache(maxsize=8192)
def first_person_first(text: str) -> bool | None:
    """Whether ``text`` names the first person before the second (True), the second before
    the first (False), or not both (None): English I / me / my / we ... and you / your ...,
    Chinese 我 and 你 / 您 (not in the greetings 你好 / 您好)."""
    t = _ZH_GREETING_RE.sub(" ", text[:MAX_GUARD_CHARS].lower().replace("\u2019", "'"))
    seen = 0
    for tok in _PERSON_RE.findall(t):
        p = _ZH_PERSON.get(tok) or (1 if tok in _EN_FIRST else 2 if tok in _EN_SECOND else 0)
        if p and not seen:
            seen = p
        elif p and p != seen:
            return seen == 1
    return None


def persons_swapped(query: str, candidate: str) -> bool:
    """True when both texts name a first and a second person, in the opposite order."""
    a, b = first_person_first(query), first_person_first(candidate)
    return a is not None and b is not None and a != b


#: Shared key terms (a CJK key character weighs half a word) from which two texts are
#: one context with a question in it: any key term that differs then rejects.
CONTEXT_SHARED_MIN = 8.0


def _weight(terms: frozenset[str]) -> float:
    return sum(0.5 if _CJK_RE.match(t) else 1.0 for t in terms)


def context_changed(query: str, candidate: str) -> bool:
    """True when the texts share a long context (key terms weighing at least
    :data:`CONTEXT_SHARED_MIN`) and their key terms differ anyway: a document, report or
    policy followed by another question ("... Can I return gift cards?" / "... Can I
    return a laptop?"), another instruction ("... Summarize this in one sentence." /
    "... List every risk mentioned.") or one word changed in a long text ("who approved"
    / "who opposed"). The shared part dominates both the pooled embedding and the
    verifier's features, so they score such pairs 0.95-0.98; a short question has no such
    context, and its rewordings are left to the other checks and the verifier. Key terms
    as :func:`key_term_substitution` reads them (stemmed, Chinese synonyms as one).

    In a long text a word is often changed into one the text already holds elsewhere
    ("... to 8:30 am ... 6:15 pm" / "... 6:15 am", a function called with "bob" / "ann"
    of a list holding both, "tls: true ... enabled: false" / "tls: false"): the sets of
    words stay the same, and so do the classes each side names, so the counts decide:
    a key term, a member of a closed class (:mod:`.contrast`) or a side of an antonym
    pair named more often while another is named less often, in a class or pair both
    texts name, is another text too (:func:`_counts_changed`)."""
    a, b = _canonical_terms(query), _canonical_terms(candidate)
    if _weight(a & b) < CONTEXT_SHARED_MIN:
        return False
    return a != b or _counts_changed(query, candidate)


@functools.lru_cache(maxsize=8192)
def _term_counts(text: str) -> Counter[str]:
    """Key terms of ``text`` as :func:`_canonical_terms` reads them, each counted."""
    t = zh_canonical(text[:MAX_GUARD_CHARS])
    found: Counter[str] = Counter(c for c in _CJK_RE.findall(t) if c not in _ZH_FUNCTION)
    for w in _EN_WORD_RE.findall(t.lower()):
        if w in _EN_STOP or w in _ANTONYM_WORDS:
            continue
        s = _stem(w)
        if s and s not in _EN_STOP:
            found[s] += 1
    return found


@functools.lru_cache(maxsize=8192)
def _antonym_counts(text: str) -> tuple[int, ...]:
    """Per slot of :class:`_AntonymIndex`, how many times ``text`` uses that side."""
    idx = _antonym_index()
    t = text[:MAX_GUARD_CHARS].lower()
    used = [0] * (2 * len(ANTONYMS))
    for w in _EN_WORD_RE.findall(t):
        for slot in idx.words.get(w, ()):
            used[slot] += 1
    for phrase, rx, slot in idx.phrases:
        if phrase in t:
            used[slot] += len(rx.findall(t))
    if not t.isascii():
        for w, slot in idx.others:
            used[slot] += t.count(w)
    return tuple(used)


def _switched(q: Mapping[Any, int], c: Mapping[Any, int]) -> bool:
    """Whether one thing is counted more in ``c`` than in ``q`` and another less: a word
    changed into another, not one only added or dropped."""
    more = any(c.get(k, 0) > n for k, n in q.items()) or any(k not in q for k in c)
    less = any(q.get(k, 0) > n for k, n in c.items()) or any(k not in c for k in q)
    return more and less


#: Pronouns a reworded question puts for a thing the text names, or names in their stead.
_STAND_INS = frozenset({"it", "its", "they", "them", "their", "this", "that", "these",
                        "those"})
_PLAIN_WORD_RE = re.compile(r"[^\W_]+")


def _pronouns_traded(query: str, candidate: str) -> bool:
    """Whether the texts' words differ only where one says "it", "they", "this" ... and
    the other names a thing in up to three words: "Does it say when the plan starts?" /
    "Does the article say when it starts?" after an article, or "What does it want changed
    in the quote?" / "What does the email want changed in it?" after an email, the same
    question with its references said the other way round."""
    a = _PLAIN_WORD_RE.findall(query[:MAX_GUARD_CHARS].lower())
    b = _PLAIN_WORD_RE.findall(candidate[:MAX_GUARD_CHARS].lower())
    lo = 0
    while lo < min(len(a), len(b)) and a[lo] == b[lo]:
        lo += 1
    end = 0
    while end < min(len(a), len(b)) - lo and a[-1 - end] == b[-1 - end]:
        end += 1
    a, b = a[lo:len(a) - end], b[lo:len(b) - end]
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    return bool(ops) and all(
        tag == "replace" and ((i2 - i1 == 1 and a[i1] in _STAND_INS and j2 - j1 <= 3)
                              or (j2 - j1 == 1 and b[j1] in _STAND_INS and i2 - i1 <= 3))
        for tag, i1, i2, j1, j2 in ops)


def _counts_changed(query: str, candidate: str) -> bool:
    """Whether, between two texts with the same key terms, one word was changed into
    another the text already holds: one key term is named more often and another less
    often, or so are two members of a closed class both texts name or the two sides of
    an antonym pair both use. A word only added or dropped ("Startups in India: Is it
    better ... in India" / "Is it better ... in India", "expect sales" / "expect any
    sales") is left to the other checks and the verifier, as in a short text, and so
    are key terms that trade places with pronouns (:func:`_pronouns_traded`)."""
    if (_switched(_term_counts(query), _term_counts(candidate))
            and not _pronouns_traded(query, candidate)):
        return True
    mq, mc = contrast_member_counts(query), contrast_member_counts(candidate)
    if any(_switched(mq[ci], mc[ci]) for ci in mq.keys() & mc.keys()):
        return True
    uq, uc = _antonym_counts(query), _antonym_counts(candidate)
    return any(_switched({0: uq[i], 1: uq[i + 1]}, {0: uc[i], 1: uc[i + 1]})
               for i in range(0, len(uq), 2))


# ---------------------------------------------------------------- the guard

def verifier_may_overrule(result: GuardResult, query: str, candidate: str) -> bool:
    """Whether the learned verifier, when it decides, may serve a pair the guard rejected:
    an English key-term substitution (``key_terms``, neither text holding a CJK
    character). The verifier sees that signal as a feature and, on English, separates
    the entity swaps ("capital of France" / "of Germany": probability 0.2-0.8 with the
    shipped verifier) from rewordings ("recipe for pancakes" / "make pancakes"), which
    the rule alone rejects by the hundreds (qqp-en: measured by ``bench/cache_quality``,
    docs/cache.md). Chinese key characters stay a rejection: there the rule keeps more
    wrong hits out than it costs."""
    return (not result.ok and result.reason == "key_terms"
            and _CJK_RE.search(query[:MAX_GUARD_CHARS]) is None
            and _CJK_RE.search(candidate[:MAX_GUARD_CHARS]) is None)


def check(query: str, candidate: str, verbatim: bool = False) -> GuardResult:
    """Decide whether ``candidate`` (the cached entry's text) may answer ``query``.

    Checks, in order: a text without a letter or digit (``no_words``: "???" against
    "!!!", only equal up to spacing may match), symbols (``symbols``: emoji, currency,
    maths and other Unicode symbols must be the same, "👍" against "👎", and so must
    operators and signs in their places, "8/2" against "8*2", "x++" against "++x":
    :mod:`.operators`), the same words where their spelling is the subject (``literal``:
    lines of code and their indentation, "it's" / "its", punctuation inside the text,
    quoted text, the case of "Polish" / "polish"; :mod:`.literal`; ``verbatim``, for a
    completion prompt: equal up to case alone), numbers,
    negation, antonyms, another member of a closed class (``contrast:<class>``:
    Sunday / Saturday, soft / hard; :mod:`.contrast`), swapped sides (``order``), speaker
    and addressee swapped
    (``persons``), past against future (``tense``), another audience (``audience``), what
    something is against how to fix it, or why against whether (``question_type``),
    the asker acting against someone else (``actor``; :mod:`.scope`), another
    question or instruction in a long shared context
    (``context``), key-term substitution (``key_terms``); the first that differs rejects.
    Never raises for ``str`` inputs (non-``str`` is treated as empty text)."""
    q = query if isinstance(query, str) else ""
    c = candidate if isinstance(candidate, str) else ""
    if (not has_words(q) or not has_words(c)) and q.split() != c.split():
        return GuardResult(False, "no_words")
    if sign_conflict(q, c):
        return GuardResult(False, "symbols")
    if literal_conflict(q, c, verbatim) or code_conflict(q, c):
        return GuardResult(False, "literal")
    if numbers_key(q) != numbers_key(c):
        return GuardResult(False, "numbers")
    if negations(q) != negations(c) or negation_moved(q, c) or negation_word_moved(q, c):
        return GuardResult(False, "negation")
    conflict = antonym_conflict(q, c)
    if conflict:
        return GuardResult(False, f"antonym:{conflict}")
    conflict = contrast_conflict(q, c)
    if conflict:
        return GuardResult(False, f"contrast:{conflict}")
    if swapped(q, c):
        return GuardResult(False, "order")
    if persons_swapped(q, c):
        return GuardResult(False, "persons")
    if sides_traded(q, c):
        return GuardResult(False, "order")
    if scope.tense_changed(q, c):
        return GuardResult(False, "tense")
    if scope.audience_changed(q, c):
        return GuardResult(False, "audience")
    if scope.definition_vs_remedy(q, c) or scope.why_vs_yes_no(q, c):
        return GuardResult(False, "question_type")
    if scope.actor_changed(q, c):
        return GuardResult(False, "actor")
    if sentence_added(q, c, _canonical_terms):
        return GuardResult(False, "added")
    if context_changed(q, c):
        return GuardResult(False, "context")
    if key_term_substitution(q, c):
        return GuardResult(False, "key_terms")
    return PASS
