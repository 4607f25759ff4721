"""The edge's JSON encoder (lua/infergate/core/jsonenc.lua), run inside nginx's init_by_lua
(support.stack.lua_eval): its default spelling (answers served from the cache, Redis
entries) and its canonical spelling (cache keys, which must match
controlplane/cache/key.py byte for byte), on control characters, Unicode, empty tables,
the ARRAY_MT/OBJECT_MT marks, large integers, floats, NaN/Inf, odd keys and the depth
limits; and that infergate.cache.key and infergate.cache.replay write through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.stack import lua_eval

from controlplane.cache.key import canonical

# name -> Lua expression of the value (A = ARRAY_MT, O = OBJECT_MT, deep(n) = n tables
# nested around "x")
CASES: dict[str, str] = {
    "ctrl": r'"\0\1\8\9\10\11\12\13\31 \127"',
    "quote": r'"a\"b\\c/d"',
    "unicode": r'"é数据\240\159\152\128"',
    "empty": "{}",
    "nested_empty": "{ a = {}, b = { {}, { c = {} } } }",
    "marks": "{ a = setmetatable({}, A), o = setmetatable({}, O), "
             "l = setmetatable({ 1, 2 }, O), m = setmetatable({ 1, 2, x = 1 }, A) }",
    "max_int": "{ 2^53 - 1, -(2^53 - 1), 2^53, 2^53 + 2, -(2^53), 2^64, -0.0, 1e15 }",
    "floats": "{ 0.1, 0.1 + 0.2, 1.5, 1e-7, 1e20, 1e300, 123456.789, 1 / 3, 0.300000000000001 }",
    "keys": '{ b = 1, a = 2, B = 3, ["é"] = 4, ["\\0"] = 5, ["k\\n"] = 6 }',
    "mixed_keys": '{ [1] = "a", x = "b" }',
    "sparse": "{ 1, nil, 3 }",
    "null": "{ a = cjson.null, b = true, c = false }",
    "function": "{ f = print }",
    "scalar": "42",
    "default_nan": "{ 0/0, math.huge, -math.huge }",
    "d100": "deep(100)",
    "d101": "deep(101)",
    "d102": "deep(102)",
    "d201": "deep(201)",
    "d202": "deep(202)",
}

ENCODE_ALL = """
    local cjson = require("cjson.safe")
    local jsonenc = require("infergate.core.jsonenc")
    local A, O = jsonenc.ARRAY_MT, jsonenc.OBJECT_MT
    local function deep(n)
        local t = "x"
        for _ = 1, n do
            t = { t }
        end
        return t
    end
    local values = {
%s
    }
    local out = {}
    for name, v in pairs(values) do
        local d, derr = jsonenc.encode(v)
        local c, cerr = jsonenc.encode(v, { canonical = true })
        out[name] = { default = d or false, default_err = derr or false,
                      canonical = c or false, canonical_err = cerr or false }
    end
    return out
"""


def encode_all(workdir: Path) -> dict[str, dict[str, Any]]:
    body = "\n".join(f"        [{json.dumps(k)}] = {v}," for k, v in CASES.items())
    return lua_eval(workdir, ENCODE_ALL % body)


def nested(n: int) -> str:
    return "[" * n + '"x"' + "]" * n


def test_both_spellings_on_tricky_values(workdir: Path) -> None:
    out = encode_all(workdir)
    want = {  # name: (default, canonical)
        "ctrl": ('"\\u0000\\u0001\\u0008\\t\\n\\u000b\\u000c\\r\\u001f \x7f"',
                 '"\\u0000\\u0001\\u0008\\u0009\\u000a\\u000b\\u000c\\u000d\\u001f \x7f"'),
        "quote": ('"a\\"b\\\\c/d"',) * 2,
        "unicode": ('"é数据😀"',) * 2,
        "empty": ("{}", "[]"),
        "nested_empty": ('{"a":{},"b":[{},{"c":{}}]}', '{"a":[],"b":[[],{"c":[]}]}'),
        "marks": ('{"a":[],"l":{},"m":[1,2],"o":{}}',
                  '{"a":[],"l":[1,2],"m":{"1":1,"2":2,"x":1},"o":[]}'),
        "max_int": ("[9007199254740991,-9007199254740991,9007199254740992,9007199254740994,"
                    "-9007199254740992,1.8446744073709552e+19,0,1000000000000000]",) * 2,
        "floats": ("[0.1,0.30000000000000004,1.5,1e-07,1e+20,1e+300,123456.789,"
                   "0.33333333333333331,0.30000000000000099]",
                   "[0.10000000000000001,0.30000000000000004,1.5,9.9999999999999995e-08,1e+20,"
                   "1.0000000000000001e+300,123456.789,0.33333333333333331,"
                   "0.30000000000000099]"),
        "keys": ('{"\\u0000":5,"B":3,"a":2,"b":1,"k\\n":6,"é":4}',
                 '{"\\u0000":5,"B":3,"a":2,"b":1,"k\\u000a":6,"é":4}'),
        "mixed_keys": ('{"x":"b"}', '{"1":"a","x":"b"}'),
        "sparse": ("{}", '{"1":1,"3":3}'),
        "null": ('{"a":null,"b":true,"c":false}',) * 2,
        "scalar": ("42",) * 2,
        "d101": (nested(101), nested(101)),
        "d201": (False, nested(201)),
    }
    for name, (default, canon) in want.items():
        got = out[name]
        assert (got["default"], got["canonical"]) == (default, canon), name
    # every default text is JSON; the canonical text too where JSON can hold the value
    for name, got in out.items():
        if got["default"]:
            json.loads(got["default"])
        if got["canonical"] and name != "default_nan":
            json.loads(got["canonical"])


def test_values_json_cannot_hold(workdir: Path) -> None:
    out = encode_all(workdir)
    assert out["function"]["default"] == '{"f":null}'
    assert out["function"]["canonical"] is False
    assert out["function"]["canonical_err"] == "not a JSON value: function"
    assert out["default_nan"]["default"] == "[null,null,null]"
    # canonical: C printf's spelling (request bodies with NaN/Infinity never get a key)
    nan, inf, ninf = out["default_nan"]["canonical"][1:-1].split(",")
    assert nan in ("nan", "-nan") and (inf, ninf) == ("inf", "-inf")


def test_depth_limits(workdir: Path) -> None:
    out = encode_all(workdir)
    # default: 101 nested tables (depths 0..100) pass, 102 fail
    assert out["d100"]["default"] == nested(100) and out["d101"]["default"] == nested(101)
    assert out["d102"] == {"default": False, "default_err": "nesting too deep",
                           "canonical": nested(102), "canonical_err": False}
    # canonical: 201 pass, 202 fail
    assert out["d202"]["canonical"] is False
    assert out["d202"]["canonical_err"] == "nesting too deep"
    assert out["d202"]["default_err"] == "nesting too deep"


def test_canonical_spelling_matches_python(workdir: Path) -> None:
    values = [{"b": 1, "a": [1.0, 0.7, -0.0, 1e20, "é\n\"\\\u0001\u001f"], "c": {}, "d": [],
               "e": None, "f": [[], {}, [{}]]},
              [True, False, 2**53, 2**53 - 1, -(2**53) - 2, 2**64, 1e-300, 5e-324, 123456.789],
              "plain \t\r\n 数据 😀", 0.1 + 0.2, {"z": {"y": {"x": [1, 2, {"w": "v"}]}}}]
    texts = json.dumps([json.dumps(v) for v in values])
    out = lua_eval(workdir, f"""
        local cjson = require("cjson.safe")
        local jsonenc = require("infergate.core.jsonenc")
        local res = {{}}
        for i, raw in ipairs(cjson.decode({json.dumps(texts)})) do
            res[i] = jsonenc.encode(cjson.decode(raw), {{ canonical = true }})
        end
        return res
    """)
    assert out == [canonical(v) for v in values]


def test_options_and_callers(workdir: Path) -> None:
    out = lua_eval(workdir, """
        local before = {}
        for k in pairs(_G) do
            before[k] = true
        end
        local jsonenc = require("infergate.core.jsonenc")
        local ck = require("infergate.cache.key")
        local replay = require("infergate.cache.replay")
        local v = { a = {}, s = "\\n", n = 0.1, l = { 1, 2 }, z = setmetatable({}, replay.ARRAY_MT) }
        local res = {
            default = jsonenc.encode(v),
            empty_opts = jsonenc.encode(v, {}),
            canonical_false = jsonenc.encode(v, { canonical = false }),
            canonical = jsonenc.encode(v, { canonical = true }),
            replay = replay.encode(v),
            cachekey = ck.canonical(v),
            same_marks = replay.ARRAY_MT == jsonenc.ARRAY_MT and replay.OBJECT_MT == jsonenc.OBJECT_MT,
            seq = { jsonenc.seq_len({}), jsonenc.seq_len({ 1, 2 }), jsonenc.seq_len({ 1, nil, 3 }) or false,
                    jsonenc.seq_len({ a = 1 }) or false },
            new_globals = {},
        }
        for k in pairs(_G) do
            if not before[k] then
                res.new_globals[#res.new_globals + 1] = k
            end
        end
        res.new_globals = #res.new_globals
        return res
    """)
    default = '{"a":{},"l":[1,2],"n":0.1,"s":"\\n","z":[]}'
    canon = '{"a":[],"l":[1,2],"n":0.10000000000000001,"s":"\\u000a","z":[]}'
    assert out["default"] == out["empty_opts"] == out["canonical_false"] == default
    assert out["replay"] == default
    assert out["canonical"] == out["cachekey"] == canon
    assert out["same_marks"] is True
    assert out["seq"] == [0, 2, False, False]
    assert out["new_globals"] == 0
