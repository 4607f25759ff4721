"""NFC at the edge (lua/infergate/core/unicode.lua, GLib through the FFI) against Python's
unicodedata, including long text that the edge normalises piece by piece."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

from support.stack import lua_eval

# Starters, combining marks, Hangul jamo and syllables, Indic two-part vowels, kana with
# voicing marks, CJK, NUL: the characters that compose, reorder or must not be joined.
ALPHABET = ["e", "\u0301", "\u00e9", "a", " ", "\u1100", "\u1161", "\u11a8", "\uac00",
            "\u4e2d", "\u0b47", "\u0b3e", "\u0327", "\u0323", "\u03b1", "\u0342", "\u0345",
            "\u3099", "\u304b", "\u00c5", "A", "\u030a", "\x00", "\u0d46", "\u0d3e", "\ufb01"]


def nfc_at_the_edge(workdir: Path, cases: list[str], setup: str = "") -> dict:
    """{"available", "res": the edge's NFC of each case} (``setup``: Lua run first, with
    the module as ``u``)."""
    (workdir / "cases.json").write_text(json.dumps(cases))
    return lua_eval(workdir, f"""
        local cjson = require("cjson.safe")
        local u = require("infergate.core.unicode")
        {setup}
        local f = assert(io.open("{workdir}/cases.json"))
        local cases = cjson.decode(f:read("*a"))
        f:close()
        local res = {{}}
        for i, c in ipairs(cases) do
            res[i] = u.nfc(c)
        end
        return {{ available = u.available, res = res }}
    """)


def test_nfc_matches_python_on_short_and_segmented_text(workdir: Path) -> None:
    rng = random.Random(7)
    cases = ["".join(rng.choice(ALPHABET) for _ in range(rng.choice([3, 40, 3000, 12000])))
             for _ in range(40)]
    out = nfc_at_the_edge(workdir, cases, "u.SEGMENT = 256   -- many cuts even in the shorter texts")
    assert out["available"] is True
    for case, got in zip(cases, out["res"]):
        assert got == unicodedata.normalize("NFC", case)


def test_long_decomposed_text_is_composed(workdir: Path) -> None:
    # 3 MB of "e" + U+0301: normalised piece by piece (in one piece GLib's composition
    # would take minutes), the cuts never separating an "e" from its accent.
    out = lua_eval(workdir, """
        local u = require("infergate.core.unicode")
        local s = string.rep("e\\204\\129", 1024 * 1024)
        local n = u.nfc(s)
        return { ok = n == string.rep("\\195\\169", 1024 * 1024) }
    """)
    assert out["ok"] is True


def _stream_safe(text: str, max_run: int = 30) -> str:
    """UAX #15 stream-safe form, written out from the standard (section 13): non-starters
    counted in each character's canonical decomposition, U+034F before a character whose
    leading ones would make the run longer than 30."""
    out, run = [], 0
    for ch in text:
        d = unicodedata.normalize("NFD", ch)
        marks = [bool(unicodedata.combining(c)) for c in d]
        lead = marks.index(False) if False in marks else len(d)
        trail = marks[::-1].index(False) if False in marks else len(d)
        if run + lead > max_run:
            out.append("\u034f")
            run = 0
        run = run + len(d) if lead == len(d) else trail
        out.append(ch)
    return "".join(out)


def test_long_runs_of_marks_are_bounded_before_normalising(workdir: Path) -> None:
    """128,000 marks of alternating classes after one letter (a 256 KB body): GLib's
    reordering is quadratic in a run of marks, so the key text is the NFC of the
    stream-safe form (a CGJ after every 30 non-starters), canonically equivalent to the
    text; short runs keep the exact NFC."""
    cases = ["a" + "\u0301\u0316" * 64000,
             "x" + "\u0316\u0301" * 20 + " tail",          # 40 marks: one CGJ
             "e" + "\u0301" * 30 + "!",                      # exactly 30: untouched
             "\u05d0" + "\u05b0\u05b4\u05bc" * 500,         # Hebrew points, other classes
             # starters that decompose into two marks each (U+0F73 = U+0F71 U+0F72, ...)
             "\u0f40" + "\u0f73\u0f75\u0f81" * 4000, "\u0f75" * 3000,
             "\u00e9" + "\u0301" * 29 + "x", "\u00e9" + "\u0301" * 30 + "x"]   # é counts its accent
    out = nfc_at_the_edge(workdir, cases)
    for case, got in zip(cases, out["res"]):
        assert got == unicodedata.normalize("NFC", _stream_safe(case))
    assert out["res"][0].count("\u034f") == 128000 // 30
    assert out["res"][1].count("\u034f") == 1
    assert out["res"][5].count("\u034f") == 3000 * 2 // 30 - 1       # 15 per run of 30 marks
    assert "\u034f" not in out["res"][6] and out["res"][7].count("\u034f") == 1
    from controlplane.cache.key import stream_safe                    # the Python side agrees
    assert [stream_safe(c) for c in cases] == [_stream_safe(c) for c in cases]
    assert out["res"][2] == unicodedata.normalize("NFC", cases[2])


def test_long_text_without_safe_cuts_is_cut_before_a_starter(workdir: Path) -> None:
    """1 MB of decomposed voiced kana (U+304B U+3099) has no ASCII, Latin or CJK character
    to cut before: the pieces end at WINDOW past SEGMENT, before a starter, so every kana
    keeps its voicing mark and the result is the exact NFC."""
    text = "\u304b\u3099" * 180000
    out = nfc_at_the_edge(workdir, [text])
    assert out["res"][0] == unicodedata.normalize("NFC", text) == "\u304c" * 180000
