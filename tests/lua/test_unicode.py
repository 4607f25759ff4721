"""NFC at the edge (lua/infergate/cache/unicode.lua, GLib through the FFI) against Python's
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


def test_nfc_matches_python_on_short_and_segmented_text(workdir: Path) -> None:
    rng = random.Random(7)
    cases = ["".join(rng.choice(ALPHABET) for _ in range(rng.choice([3, 40, 3000, 12000])))
             for _ in range(40)]
    (workdir / "cases.json").write_text(json.dumps(cases))
    out = lua_eval(workdir, f"""
        local cjson = require("cjson.safe")
        local u = require("infergate.cache.unicode")
        u.SEGMENT = 256   -- many cuts even in the shorter texts
        local f = assert(io.open("{workdir}/cases.json"))
        local cases = cjson.decode(f:read("*a"))
        f:close()
        local res = {{}}
        for i, c in ipairs(cases) do
            res[i] = u.nfc(c)
        end
        return {{ available = u.available, res = res }}
    """)
    assert out["available"] is True
    for case, got in zip(cases, out["res"]):
        assert got == unicodedata.normalize("NFC", case)


def test_long_decomposed_text_is_composed(workdir: Path) -> None:
    # 3 MB of "e" + U+0301: normalised piece by piece (in one piece GLib's composition
    # would take minutes), the cuts never separating an "e" from its accent.
    out = lua_eval(workdir, """
        local u = require("infergate.cache.unicode")
        local s = string.rep("e\\204\\129", 1024 * 1024)
        local n = u.nfc(s)
        return { ok = n == string.rep("\\195\\169", 1024 * 1024) }
    """)
    assert out["ok"] is True
