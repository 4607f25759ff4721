"""Precision guard: reject a semantic candidate whose meaning likely differs from the query
even though the embeddings are close.

Small sentence embedders place "借款1万" next to "借款5万", "enable X" next to "disable X"
and "can I" next to "can't I": the words that flip the answer are few and carry little
weight in a pooled vector. The guard compares those words directly, on the query text and
the cached entry's text (the last user message of each):

- ``numbers``: the multiset of numbers differs (Arabic digits with ``,`` thousands and
  decimals; Chinese numerals with a magnitude such as 一万 / 两千 / 五十, or followed by a
  counter such as 三个月; ``1万`` is 10000). A lone 一 (一下, 一个) is not a number.
- ``negation``: a negation is present in one text only (English ``not``, ``no``,
  ``never``, ``n't`` ...; Chinese 不 / 没 / 无 / 未 / 别 / 非 / 否 / 勿, after removing
  A-not-A questions such as 能不能 / 有没有 and words that do not negate such as 不错,
  非常, 别人, 是否, 未来).
- ``antonym:<a>/<b>``: both texts use a word of the pair (enable/disable, 借/还, 开通/关闭,
  增加/减少, ...) but not the same side of it.

All functions are pure (no I/O) and never raise on any ``str`` input. Results are
deterministic. The effect on the labelled dev sets is measured by ``bench/cache_quality``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

MAX_GUARD_CHARS = 4000
"""Only the first 4000 characters of each text are compared (bounded work)."""


@dataclass(frozen=True)
class GuardResult:
    """``ok`` True when the candidate may be served; else ``reason`` names the first check
    that failed: ``numbers`` | ``negation`` | ``antonym:<a>/<b>``."""

    ok: bool
    reason: str | None = None

    @property
    def label(self) -> str:
        """``"pass"`` or ``"reject:<reason>"`` (the wire form of the lookup answer)."""
        return "pass" if self.ok else f"reject:{self.reason}"


PASS = GuardResult(True, None)

# ---------------------------------------------------------------- numbers

_CN_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5,
              "六": 6, "七": 7, "八": 8, "九": 9}
_CN_SMALL_UNITS = {"十": 10, "百": 100, "千": 1000}
_CN_BIG_UNITS = {"万": 10_000, "亿": 100_000_000}
_CN_NUM_CHARS = "".join(_CN_DIGITS) + "".join(_CN_SMALL_UNITS) + "".join(_CN_BIG_UNITS)
_COUNTERS = "个元块月年天日期次号岁分秒周笔张笔倍成折件位名条家层"

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
    """Value of a Chinese numeral (一万五千 -> 15000, 三 -> 3, 十二 -> 12); None if not one."""
    total, section, digit = 0, 0, None
    for ch in s:
        if ch in _CN_DIGITS:
            if digit is not None:  # digit sequence read digit by digit (二零二四)
                digit = digit * 10 + _CN_DIGITS[ch]
            else:
                digit = _CN_DIGITS[ch]
        elif ch in _CN_SMALL_UNITS:
            section += (1 if digit is None else digit) * _CN_SMALL_UNITS[ch]
            digit = None
        elif ch in _CN_BIG_UNITS:
            section += digit or 0
            total += (section or 1) * _CN_BIG_UNITS[ch]
            section, digit = 0, None
        else:
            return None
    return total + section + (digit or 0)


def numbers(text: str) -> Counter[str]:
    """Multiset of the numbers written in ``text``, as canonical strings.

    ``"借款1万"`` -> ``{"10000": 1}``; ``"10,000 and 3.10"`` -> ``{"10000", "3.10"}``;
    ``"三个月"`` -> ``{"3"}``; ``"查一下"`` -> ``{}``."""
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
        if s in ("一", "〇", "零") and not has_unit:
            continue  # 一下 / 一个 / 统一: not a quantity worth comparing
        if not has_unit and nxt not in _COUNTERS and len(s) < 2:
            continue  # a lone digit character inside a word (三星, 五花肉)
        value = _parse_cn(s)
        if value is not None:
            found[str(value)] += 1
    return found


# ---------------------------------------------------------------- negation

_EN_WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)?")
_EN_NEGATIONS = frozenset({
    "not", "no", "never", "cannot", "without", "nor", "neither", "none", "nothing",
    "nobody", "nowhere", "unable",
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


def negated(text: str) -> bool:
    """True when ``text`` contains a negation (English or Chinese), see module doc."""
    t = text[:MAX_GUARD_CHARS].lower().replace("’", "'")
    if _EN_NT_RE.search(t):
        return True
    if any(w in _EN_NEGATIONS for w in _EN_WORD_RE.findall(t)):
        return True
    z = _ZH_A_NOT_A_RE.sub(r"\1", t)
    for w in _ZH_NOT_NEGATING:
        z = z.replace(w, "")
    return any(c in z for c in _ZH_NEGATIONS)


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


def _has(text_lower: str, words_en: frozenset[str], word: str) -> bool:
    if word.isascii():
        if " " in word:
            return re.search(rf"\b{re.escape(word)}\b", text_lower) is not None
        return word in words_en
    return word in text_lower


def _sides(text_lower: str, words_en: frozenset[str],
           a: tuple[str, ...], b: tuple[str, ...]) -> tuple[bool, bool]:
    return (any(_has(text_lower, words_en, w) for w in a),
            any(_has(text_lower, words_en, w) for w in b))


def antonym_conflict(query: str, candidate: str) -> str | None:
    """Name of the first antonym pair the two texts use on different sides, else None.

    A conflict needs one text to use only side A and the other only side B: "enable X" vs
    "disable X" conflicts; "enable X" vs "turn X on" (same side), "enable X" vs "X settings"
    (pair unused) and "enable X" vs "enable or disable X" (both sides) do not."""
    q, c = query[:MAX_GUARD_CHARS].lower(), candidate[:MAX_GUARD_CHARS].lower()
    qw, cw = frozenset(_EN_WORD_RE.findall(q)), frozenset(_EN_WORD_RE.findall(c))
    for name, a, b in ANTONYMS:
        sq, sc = _sides(q, qw, a, b), _sides(c, cw, a, b)
        if {sq, sc} == {(True, False), (False, True)}:
            return name
    return None


# ---------------------------------------------------------------- the guard

def check(query: str, candidate: str) -> GuardResult:
    """Decide whether ``candidate`` (the cached entry's text) may answer ``query``.

    Checks, in order: numbers, negation, antonyms; the first that differs rejects.
    Never raises for ``str`` inputs (non-``str`` is treated as empty text)."""
    q = query if isinstance(query, str) else ""
    c = candidate if isinstance(candidate, str) else ""
    if numbers(q) != numbers(c):
        return GuardResult(False, "numbers")
    if negated(q) != negated(c):
        return GuardResult(False, "negation")
    conflict = antonym_conflict(q, c)
    if conflict:
        return GuardResult(False, f"antonym:{conflict}")
    return PASS
