"""The per-worker memo of cache keys by raw request body (infergate.cache.key.keys_for):
the same keys as keys(), one computation per body and variant, large bodies left out,
and a full memo starting afresh; run inside nginx (support.stack.lua_eval)."""

from __future__ import annotations

from support.stack import lua_eval


def test_keys_for_matches_keys_and_computes_once_per_body(workdir) -> None:
    got = lua_eval(workdir, """
        local cjson = require("cjson.safe")
        local ck = require("infergate.cache.key")
        local path = "/v1/chat/completions"
        local raw = '{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false}'
        local body = cjson.decode(raw)
        local computed = 0
        local keys = ck.keys
        ck.keys = function(...) computed = computed + 1; return keys(...) end
        local out = {}
        local a = ck.keys_for(raw, path, body, "t1", false)
        local b = ck.keys_for(raw, path, body, "t1", false)
        out.same_table = a == b
        out.after_two = computed
        local direct = keys(path, body, "t1", false)
        out.equal = a.exact == direct.exact and a.namespace == direct.namespace
            and a.text == direct.text
        -- another tenant, path or variant is another entry
        out.other_tenant = ck.keys_for(raw, path, body, "t2", false).exact ~= a.exact
        ck.keys_for(raw, path, body, "t1", true)
        out.after_variants = computed
        -- a body over MEMO_BODY_MAX is computed every time
        local big = string.rep(" ", ck.MEMO_BODY_MAX) .. raw
        ck.keys_for(big, path, body, "t1", false)
        ck.keys_for(big, path, body, "t1", false)
        out.after_big = computed
        -- a full memo starts afresh: the first body is computed again
        for i = 1, ck.MEMO_MAX do
            ck.keys_for(raw .. string.rep(" ", i), path, body, "t1", false)
        end
        local before = computed
        ck.keys_for(raw, path, body, "t1", false)
        out.recomputed = computed - before
        ck.keys = keys
        return out
    """)
    assert got["same_table"] is True and got["after_two"] == 1
    assert got["equal"] is True
    assert got["other_tenant"] is True
    assert got["after_variants"] == 3
    assert got["after_big"] == 5
    assert got["recomputed"] == 1


def test_bounded_memo_starts_afresh_when_full(workdir) -> None:
    got = lua_eval(workdir, """
        local memo = require("infergate.core.memo")
        local m = memo.new(3)
        m:set("a", 1); m:set("b", 2); m:set("a", 10)   -- a key set again is not a new key
        local out = {a = m:get("a"), b = m:get("b")}
        m:set("c", 3)
        out.full_a = m:get("a")
        m:set("d", 4)                                   -- a fourth key: emptied first
        out.after_a, out.after_d = m:get("a"), m:get("d")
        return out
    """)
    assert got == {"a": 10, "b": 2, "full_a": 10, "after_d": 4}


def test_prefixer_builds_each_key_once(workdir) -> None:
    got = lua_eval(workdir, """
        local prefixer = require("infergate.core.memo").prefixer
        local if_key, sp_key = prefixer("if:"), prefixer("sp:")
        local a = if_key("node-a")
        return {a = a, again = if_key("node-a"), b = if_key("node-b"), sp = sp_key("node-a"),
                same = rawequal(a, if_key("node-a"))}
    """)
    assert got == {"a": "if:node-a", "again": "if:node-a", "b": "if:node-b",
                   "sp": "sp:node-a", "same": True}
