"""Cache keys: the Lua edge (lua/infergate/cache/key.lua, run inside nginx) and Python
(controlplane/cache/key.py) compute the same exact keys and namespaces; SHA-256 (FFI and
pure Lua) against hashlib. What changes a key and what does not:
tests/unit/test_cache_key_rules.py."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from controlplane.cache.key import UnkeyableBody, canonical, keys_for
from support.stack import lua_eval

CHAT = "/v1/chat/completions"


def _payload_file(workdir, data) -> str:
    """Write ``data`` as JSON to a file (nginx limits inline Lua size) and return Lua that
    reads it back into the local ``payload``."""
    path = workdir / f"payload-{random.randrange(10**9)}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return f'local f = io.open("{path}", "rb"); local payload = f:read("*a"); f:close()'


COMP = "/v1/completions"


def _bodies() -> list[tuple[str, str, dict]]:
    """(path, tenant, body) cases covering the spec's corners."""
    base = {"model": "m", "messages": [{"role": "user", "content": "What is Redis?"}]}
    cases: list[tuple[str, str, dict]] = [
        (CHAT, "default", base),
        (CHAT, "acme", base),
        (CHAT, "default", {**base, "stream": True, "stream_options": {"include_usage": True},
                           "user": "u1"}),
        (CHAT, "default", {**base, "temperature": 0}),
        (CHAT, "default", {**base, "temperature": 0.0}),
        (CHAT, "default", {**base, "temperature": 0.7, "top_p": 0.95, "seed": 42,
                           "max_tokens": 100, "max_completion_tokens": 50, "n": 1,
                           "stop": ["\n", "END"], "logit_bias": {"50256": -100},
                           "logprobs": True, "top_logprobs": 3, "frequency_penalty": 0.5,
                           "presence_penalty": -0.25}),
        (CHAT, "default", {**base, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}}, "required": ["city"]}}}],
            "tool_choice": "auto", "response_format": {"type": "json_object"}}),
        (CHAT, "default", {**base, "tools": [], "metadata": {}, "x_extra": [1, [2, {}]]}),
        (CHAT, "default", {"model": "m", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                         {"type": "text", "text": "about Lua"}]}]}),
        (CHAT, "default", {"model": "m", "messages": [
            {"role": "user", "content": "call it"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content": "   \n\t"}]}),
        (CHAT, "default", {"model": "m", "messages": []}),
        (CHAT, "default", {"model": "m"}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content":
                                                       "如何重置我的密码？"}]}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content":
                                                       "caf\u00e9 \U0001F600 \u0000 \u001f \"q\" \\ /"}]}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content": "cafe\u0301"}]}),
        # runs of more than 30 marks: both sides key their stream-safe form
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content":
                                                       "a" + "\u0301\u0316" * 500 + " b\u0301"}]}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9"}]}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content": "\u1100\u1161 \ufb01"}],
                           "metadata": {"e\u0301": 1, "\u00e9a": 2, "z": "A\u030a"}}),
        (CHAT, "tenant with spaces/ünïcode", base),
        (CHAT, "default", {**base, "small": 1e-7, "neg": -0.0, "frac": 0.1, "third": 1 / 3,
                           "max_safe": 2**53 - 1, "min_safe": -(2**53) + 1,
                           "bools": [True, False, None]}),
        (COMP, "default", {"model": "m", "prompt": "Once upon a time", "max_tokens": 16}),
        (COMP, "default", {"model": "m", "prompt": ["a", "b"]}),
        (COMP, "default", {"model": "m", "prompt": [1, 2, 3]}),
        (CHAT, "default", {"model": "m", "messages": [{"role": "user", "content": "x" * 50000}]}),
    ]
    rnd = random.Random(7)
    words = ["alpha", "βeta", "гамма", "数据", "x\ny", "q\"t", "", "0"]
    for i in range(40):
        msgs = [{"role": rnd.choice(["system", "user", "assistant"]), "content": " ".join(
            rnd.choice(words) for _ in range(rnd.randint(1, 6)))} for _ in range(rnd.randint(1, 4))]
        msgs.append({"role": "user", "content": rnd.choice(words) + str(i)})
        body: dict = {"model": rnd.choice(["a", "b"]), "messages": msgs}
        if rnd.random() < 0.5:
            body["temperature"] = rnd.choice([0, 0.2, 1, 1.5, 0.123456789])
        if rnd.random() < 0.3:
            body["stop"] = [rnd.choice(words)]
        cases.append((CHAT, rnd.choice(["default", "t1"]), body))
    return cases


def test_python_and_lua_keys_agree(workdir) -> None:
    cases = _bodies()
    read = _payload_file(workdir, [[p, t, json.dumps(b)] for p, t, b in cases])
    out = lua_eval(workdir, f"""
        {read}
        local cjson = require("cjson.safe")
        local ck = require("infergate.cache.key")
        local cases = cjson.decode(payload)
        local res = {{}}
        for i, c in ipairs(cases) do
            local k, err = ck.keys(c[1], cjson.decode(c[3]), c[2])
            if not k then error(err) end
            res[i] = {{ k.exact, k.namespace or cjson.null, k.text or cjson.null }}
        end
        return {{ ffi = ck.ffi_available, keys = res }}
    """)
    assert out["ffi"] is True  # Debian's nginx links libcrypto
    assert len(out["keys"]) == len(cases)
    for (path, tenant, body), (exact, ns, text) in zip(cases, out["keys"]):
        k = keys_for(path, body, tenant)
        assert (exact, ns, text) == (k.exact, k.namespace, k.semantic_text), (path, tenant, body)


def test_numbers_of_2_to_the_53_or_more_have_no_key_on_either_side(workdir) -> None:
    """The edge decodes numbers as doubles, where 2^53 + 1 and 2^53 are the same: a body
    holding such a number anywhere but in the excluded fields has no key (never cached),
    on both sides alike."""
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    unkeyable = [{**base, "seed": 2**53}, {**base, "seed": 2**53 + 1}, {**base, "seed": -(2**53)},
                 {**base, "max_tokens": 10**20}, {**base, "max_tokens": 1e20},
                 {**base, "tools": [{"type": "function", "function": {
                     "name": "f", "parameters": {"maximum": 1e300}}}]}]
    keyable = [{**base, "seed": 2**53 - 1}, {**base, "user": 2**60, "stream": False}]
    bodies = unkeyable + keyable
    read = _payload_file(workdir, [json.dumps(b) for b in bodies])
    out = lua_eval(workdir, f"""
        {read}
        local cjson = require("cjson.safe")
        local ck = require("infergate.cache.key")
        local res = {{}}
        for i, raw in ipairs(cjson.decode(payload)) do
            local k, err = ck.keys("{CHAT}", cjson.decode(raw), "default")
            res[i] = k and k.exact or ("error: " .. err)
        end
        return res
    """)
    for body, got in zip(unkeyable, out):
        assert got.startswith("error: a number of 2^53 or more"), body
        with pytest.raises(UnkeyableBody):
            keys_for(CHAT, body)
    for body, got in zip(keyable, out[len(unkeyable):]):
        assert got == keys_for(CHAT, body).exact


def test_canonical_text_is_identical(workdir) -> None:
    values = [{"b": 1, "a": [1.0, 0.7, -0.0, 1e20, "é\n\"\\"], "c": {}, "d": [], "e": None},
              [True, False, 2**53, 2**53 - 1, 1e-300, 123456.789], "plain", 0.1 + 0.2]
    read = _payload_file(workdir, [json.dumps(v) for v in values])
    lua = lua_eval(workdir, f"""
        {read}
        local cjson = require("cjson.safe")
        local ck = require("infergate.cache.key")
        local out = {{}}
        for i, raw in ipairs(cjson.decode(payload)) do
            out[i] = ck.canonical(cjson.decode(raw))
        end
        return out
    """)
    assert lua == [canonical(v) for v in values]
    assert lua[0] == ('{"a":[1,0.69999999999999996,0,1e+20,"é\\u000a\\"\\\\"],"b":1,"c":[],'
                      '"d":[],"e":null}')


def test_sha256_ffi_and_pure_lua_match_hashlib(workdir) -> None:
    rnd = random.Random(3)
    msgs = ["", "abc", "a" * 55, "a" * 56, "a" * 63, "a" * 64, "a" * 65, "a" * 119, "a" * 120,
            "数据库" * 100, "".join(chr(rnd.randint(32, 0x2FFF)) for _ in range(3000))]
    read = _payload_file(workdir, msgs)
    out = lua_eval(workdir, f"""
        {read}
        local cjson = require("cjson.safe")
        local ck = require("infergate.cache.key")
        local res = {{}}
        for i, m in ipairs(cjson.decode(payload)) do
            res[i] = {{ ck.sha256_hex(m), ck.sha256_hex_lua(m) }}
        end
        return res
    """)
    for m, (ffi_hex, lua_hex) in zip(msgs, out):
        want = hashlib.sha256(m.encode()).hexdigest()
        assert ffi_hex == want and lua_hex == want

