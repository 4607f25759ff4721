"""Pure logic of admission control: settings and their defaults in the example file,
the edge option and its validation in Lua, the token-bucket script on a real Redis,
and the Lua helpers (durations, token estimates, Bearer parsing, key records, usage
parsing, deadline timeouts, local buckets), run inside nginx's Lua."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from controlplane.config import ConfigError, load_settings, settings_from_dict
from controlplane.edge.options import edge_document, lua_string, option_spec, rendered_options
from controlplane.edge.render import render_nginx
from support.stack import LuaError, lua_eval

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "infergate.example.toml"
SECTIONS = ("auth", "limits", "admission", "deadlines")
DICTS = "lua_shared_dict infergate_limits 1m; lua_shared_dict infergate_auth 1m;"


# --------------------------------------------------------------------------- settings

def test_example_file_documents_the_defaults() -> None:
    s, d = load_settings(EXAMPLE), load_settings(None)
    for section in SECTIONS:
        assert getattr(s, section) == getattr(d, section), section
    assert d.auth.mode == "off" and d.deadlines.request_ms == 30000
    assert d.admission.max_wait_ms == 500 and d.auth.cache_ttl_s == 5.0


@pytest.mark.parametrize("data, message", [
    ({"auth": {"mode": "maybe"}}, "auth.mode"),
    ({"auth": {"cache_ttl_s": 0}}, "auth.cache_ttl_s"),
    ({"limits": {"global_rpm": -1}}, "limits.global_rpm"),
    ({"limits": {"chars_per_token": 0}}, "limits.chars_per_token"),
    ({"limits": {"chars_per_token": 0.005}}, "limits.chars_per_token: 0.005 is below the minimum 0.01"),
    ({"admission": {"retry_after_s": 0}}, "admission.retry_after_s"),
    ({"admission": {"poll_ms": 0}}, "admission.poll_ms"),
    ({"deadlines": {"stream_idle_ms": 0}}, "deadlines.stream_idle_ms"),
    ({"deadlines": {"routes": {"v1/chat": {"request_ms": 5}}}}, "unknown path 'v1/chat'"),
    ({"deadlines": {"routes": {"/v1/chat": {"request_ms": 5}}}}, "unknown path"),
    ({"deadlines": {"routes": {"/v1/chat/completions": {"bogus": 5}}}}, "bogus"),
])
def test_bad_settings_are_named(data, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings_from_dict(data)


def test_edge_option_round_trips_through_lua(workdir: Path) -> None:
    s = settings_from_dict({
        "auth": {"mode": "required", "cache_ttl_s": 2},
        "limits": {"global_rpm": 100, "global_tpm": 5000},
        "admission": {"shed": False, "max_wait_ms": 250},
        "deadlines": {"request_ms": 9000,
                      "routes": {"/v1/embeddings": {"request_ms": 2000}}},
    })
    opts = edge_document(s)
    assert opts["deadlines"]["routes"] == {"/v1/embeddings": {"request_ms": 2000,
                                                              "stream_idle_ms": None}}
    assert opts["auth"]["cache_ttl_s"] == 2.0 and opts["admission"]["shed"] is False
    r = render_nginx(s, workdir / "out", listen="127.0.0.1:18140")
    doc, spec = rendered_options(r.http_conf.read_text())
    got = lua_eval(workdir, f"""
            local config = require("infergate.core.config")
            assert(config.init({lua_string(json.dumps(doc))}, {lua_string(json.dumps(spec))}))
            local o = config.get()
            return {{ mode = o.auth.mode, ttl = o.auth.cache_ttl_s, rpm = o.limits.global_rpm,
                      shed = o.admission.shed, wait = o.admission.max_wait_ms,
                      emb = o.deadlines.routes["/v1/embeddings"],
                      req = o.deadlines.request_ms, idle = o.deadlines.stream_idle_ms }}
    """)
    # a route entry is completed with the global values
    assert got == {"mode": "required", "ttl": 2, "rpm": 100, "shed": False, "wait": 250,
                   "emb": {"request_ms": 2000, "stream_idle_ms": 30000},
                   "req": 9000, "idle": 30000}


def test_lua_defaults_equal_the_python_defaults(workdir: Path) -> None:
    got = lua_eval(workdir, f"""
            assert(require("infergate.core.config").init("{{}}",
                {lua_string(json.dumps(option_spec()))}))
            local o = require("infergate.core.config").get()
            o.deadlines.routes = nil
            return {{ auth = o.auth, limits = o.limits, admission = o.admission,
                      deadlines = o.deadlines }}
    """)
    d = edge_document(load_settings(None))
    deadlines = dict(d["deadlines"])
    deadlines.pop("routes")
    # the sections under their names in infergate.toml, nothing renamed
    assert got == {"auth": d["auth"], "limits": d["limits"], "admission": d["admission"],
                   "deadlines": deadlines}


@pytest.mark.parametrize("options, message", [
    ('{"bogus": {}}', "bogus: unknown option"),
    ('{"auth": {"mode": "maybe"}}', 'auth.mode: "maybe" is not one of "off", "required"'),
    ('{"auth": {"nope": 1}}', "auth.nope: unknown option"),
    ('{"limits": {"global_rpm": "5"}}', "limits.global_rpm: must be an integer"),
    ('{"limits": {"chars_per_token": 0.005}}', "limits.chars_per_token: 0.005 is below the minimum 0.01"),
    ('{"admission": {"max_wait_ms": -1}}', "admission.max_wait_ms: -1 is below the minimum 0"),
    ('{"deadlines": {"routes": {"x": {}}}}', "deadlines.routes: unknown path 'x'"),
    ('{"deadlines": {"routes": {"/v1/embeddings": {"request_ms": true}}}}',
     'deadlines.routes["/v1/embeddings"].request_ms: must be an integer'),
    ('{"admission": 5}', "admission: must be an object"),
    ('{"auth": "off"}', "auth: must be an object"),
])
def test_lua_rejects_bad_admission_options(workdir: Path, options: str, message: str) -> None:
    with pytest.raises(LuaError, match=re.escape(message)):
        lua_eval(workdir, f"""
            local ok, err = require("infergate.core.config").init([==[{options}]==],
                {lua_string(json.dumps(option_spec()))})
            if not ok then error(err, 0) end
            return true
        """)


# --------------------------------------------------------------------------- Lua helpers

def test_reset_durations_look_like_openai(workdir: Path) -> None:
    cases = [0, 0.0004, 0.012, 0.9999, 1, 1.5, 20, 59.9994, 60, 360, 3725.25, 7200]
    got = lua_eval(workdir, f"""
            local rl = require("infergate.admission.ratelimit")
            local out = {{}}
            for i, s in ipairs({{{", ".join(map(str, cases))}}}) do out[i] = rl.duration(s) end
            return out
    """, http_extra=DICTS)
    assert got == ["0s", "1ms", "12ms", "1s", "1s", "1.5s", "20s", "1m0s", "1m0s", "6m0s",
                   "1h2m5.25s", "2h0m0s"]


def test_remaining_in_the_headers_is_never_above_the_limit(workdir: Path) -> None:
    """x-ratelimit-remaining-*: a bucket's tokens plus what the worker holds granted
    ahead (infergate.admission.leases) can exceed the capacity; the header says at most
    the limit, and the reset is 0 then."""
    got = lua_eval(workdir, """
            local rlh = require("infergate.admission.rlheaders")
            local list = {{kind = "requests", capacity = 2, rate = 2 / 60},
                          {kind = "tokens", capacity = 20000, rate = 20000 / 60}}
            return rlh.headers(list, {tokens = {1.5, 20021}})
    """, http_extra=DICTS)
    assert got["x-ratelimit-remaining-tokens"] == "20000"
    assert got["x-ratelimit-limit-tokens"] == "20000" and got["x-ratelimit-reset-tokens"] == "0s"
    assert got["x-ratelimit-remaining-requests"] == "1"


def test_prompt_token_estimate(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local rl = require("infergate.admission.ratelimit")
            local e = rl.estimate_tokens
            return {
                e({messages = {{role = "system", content = "12345678"},
                               {role = "user", content = "abcd"}}}, 4),
                e({messages = {{role = "user", content = {{type = "text", text = "abcdefgh"},
                                                         {type = "image_url", image_url = {}}}}}}, 4),
                e({prompt = "héllo wörld"}, 4),
                e({prompt = {"aaaa", "bbbb", "cc"}}, 4),
                e({input = "x"}, 4),
                e({model = "m"}, 4),
                e({messages = {{role = "user", content = string.rep("z", 10)}}}, 2.5),
                rl.prompt_chars("not a table"),
            }
    """, http_extra=DICTS)
    assert got == [3, 2, 3, 3, 1, 1, 4, 0]


def test_usage_keeps_the_last_bytes_of_a_body_in_pieces(workdir: Path) -> None:
    got = lua_eval(workdir, r"""
            local u = require("infergate.admission.usage")
            u.TAIL = 10
            local req, whole = {}, ""
            for i = 1, 40 do
                local piece = string.rep(string.char(64 + i % 26), i % 4 + 1)
                u.keep(req, piece)
                whole = whole .. piece
            end
            local one = {}
            u.keep(one, "abc")
            return {u.tail(req), whole:sub(-10), req.usage_n - req.usage_first + 1,
                    u.tail(one), u.tail({}) or "nil",
                    u.content_chunks('"content": "a" "content":"" "content" :"b"'),
                    u.content_chunks('no content key'), u.content_chunks('"content": null')}
    """)
    assert got[0] == got[1]
    assert got[2] <= 6                           # a few pieces kept, not all 40
    assert got[3:5] == ["abc", "nil"]
    assert got[5:] == [2, 0, 0]


def test_characters_are_code_points(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local chars = require("infergate.core.body").chars
            return {chars(""), chars("abc"), chars("héllo wörld"), chars("日本語"),
                    chars("😀!"), chars(string.rep("é", 1000)), chars("\\128\\191x")}
    """)
    # continuation bytes (0x80-0xBF) are not counted, a lone one included
    assert got == [0, 3, 11, 3, 2, 1000, 1]


def test_bearer_parsing_and_key_records(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local auth = require("infergate.admission.auth")
            local b = auth.bearer
            local rec = auth.from_record
            local function keys_of(e)
                local out = {}
                for k, v in pairs(e) do out[#out + 1] = k .. "=" .. tostring(v) end
                table.sort(out)
                return table.concat(out, ",")
            end
            return {
                b("Bearer ig-abc"), b("bearer   ig-abc  "), b("BEARER x"),
                b("Basic abc") or "nil", b("Bearer") or "nil", b("Bearer a b") or "nil",
                b(nil) or "nil", b({"Bearer a", "Bearer b"}) or "nil",
                keys_of(rec('{"id": "0a1b2c3d", "tenant": "acme", "rpm": 3, "tpm": null, '
                            .. '"revoked": null}', 7)),
                keys_of(rec('{"id": "0a1b2c3d", "tenant": "acme", "revoked": 1700000000.5}', 7)),
                keys_of(rec('{"tenant": ""}', 7)),
                keys_of(rec('not json', 7)),
                keys_of(rec(ngx.null, 7)),
                keys_of(rec('{"id": "x", "tenant": "t", "rpm": 0, "tpm": "9"}', 7)),
            }
    """, http_extra=DICTS)
    assert got[:8] == ["ig-abc", "ig-abc", "x", "nil", "nil", "nil", "nil", "nil"]
    assert got[8] == "at=7,id=0a1b2c3d,ok=true,rpm=3,tenant=acme"
    assert got[9:12] == ["at=7,ok=false"] * 3
    assert got[12] == "at=7,ok=false"
    assert got[13] == "at=7,id=x,ok=true,tenant=t"  # bad limits count as none


def test_usage_parsing(workdir: Path) -> None:
    got = lua_eval(workdir, r"""
            local u = require("infergate.admission.usage")
            local json = '{"choices": [{"message": {"content": "a \"usage\": {\"total_tokens\": 999}"}}],'
                .. ' "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}}'
            local sse = 'data: {"choices": [{"delta": {"content": "hi"}}], "usage": null}\n\n'
                .. 'data: {"choices": [{"delta": {"content": " there"}}], "usage": null}\n\n'
                .. 'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, '
                .. '"total_tokens": 7}}\n\ndata: [DONE]\n\n'
            local no_total = '"usage": {"prompt_tokens": 4, "completion_tokens": 6}'
            local chunks = 'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
                .. 'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
                .. 'data: {"choices": [{"delta": {"content":"b"}}]}\n\n'
            return {
                u.parse(json), u.parse(sse), u.parse(no_total),
                u.parse("no usage here") or "nil", u.parse('"usage": {}') or "nil",
                u.content_chunks(chunks),
                -- a later "usage" that is a value, not a key of an object
                u.parse('{"usage": {"total_tokens": 3}, "object": "usage"}'),
            }
    """)
    assert got[0] == {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}
    assert got[1] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert got[2] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert got[3:5] == ["nil", "nil"]
    assert got[5] == 2
    assert got[6] == {"total_tokens": 3}


def test_deadline_timeouts_per_try(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local dl = require("infergate.admission.deadline")
            local o = {edge = {connect_timeout_ms = 2000, send_timeout_ms = 60000, read_timeout_ms = 60000}}
            local function t(stream, at, idle, now)
                local req = {stream = stream, deadline = {at = at, request_ms = 1, idle_s = idle}}
                local c, s, r, bound = dl.timeouts(req, o, now)
                if not c then return "none" end
                return {c, s, r, bound}
            end
            return {
                t(false, 130, 30, 100),     -- 30 s left: read bounded by the deadline
                t(false, 100.5, 30, 100),   -- 0.5 s left: every timeout capped
                t(false, nil, 30, 100),     -- no deadline: the edge's timeouts
                t(true, 130, 5, 100),       -- stream: idle timeout, not the deadline
                t(true, 200, 90, 100),      -- idle above read_timeout_ms: read_timeout_ms
                t(false, 100, 30, 100),     -- passed: no new try
                t(true, 99, 30, 100),       -- passed for streams as well
            }
    """)
    assert got[0] == [2, 30, 30, True]
    assert got[1] == [0.5, 0.5, 0.5, True]
    assert got[2] == [2, 60, 60, False]
    assert got[3] == [2, 30, 5, False]
    assert got[4] == [2, 60, 60, False]
    assert got[5:] == ["none", "none"]


def test_no_retry_in_the_last_moments_of_the_deadline(workdir: Path) -> None:
    # a try bounded by the deadline times out a few ms before it: a retry would only be
    # sent to a node to time out at once (and be named for it); a first try still starts
    got = lua_eval(workdir, """
            local dl = require("infergate.admission.deadline")
            require("ngx.balancer").set_timeouts = function() return true end  -- no request here
            local o = {edge = {connect_timeout_ms = 2000, send_timeout_ms = 60000, read_timeout_ms = 60000}}
            local function try(left, retry)
                local req = {deadline = {at = 100 + left, request_ms = 1, idle_s = 30}}
                return dl.before_try(req, o, 100, retry)
            end
            return {try(0.02, true), try(0.02, false), try(dl.RETRY_MIN_S + 0.01, true),
                    try(-1, false)}
    """)
    assert got == [False, True, True, False]


def test_local_buckets(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local rl = require("infergate.admission.ratelimit")
            local list = {
                {kind = "requests", scope = "key", key = "k:rpm", capacity = 3, rate = 3 / 60, cost = 1},
                {kind = "tokens", scope = "key", key = "k:tpm", capacity = 100, rate = 100 / 60, cost = 40},
            }
            local out = {}
            for i = 1, 4 do
                local res = rl._local_apply("take", list)
                out[i] = {res.allowed, math.floor(res.tokens[1] + 0.5), math.floor(res.tokens[2] + 0.5),
                          math.floor(res.wait[2] + 0.5)}
            end
            -- the answers used 150 tokens more than estimated: debt (down to -60 x capacity)
            local adj = rl._local_apply("adjust", {list[2]}, {150})
            out[7] = math.floor(rl._local_apply("adjust", {list[2]}, {10000}).tokens[1] + 0.5)
            out[5] = math.floor(adj.tokens[1] + 0.5)
            local h = rl.headers({list[1]}, rl._local_apply("take", {list[1]}))
            out[6] = h
            return out
    """, http_extra=DICTS)
    # requests 3 -> 2 -> 1 ; tokens 100 -> 60 -> 20 ; the third is refused by tokens and
    # charges nothing (all or none)
    assert got[0] == [True, 2, 60, 0]
    assert got[1] == [True, 1, 20, 0]
    assert got[2] == [False, 1, 20, 12]   # (40 - 20) / (100/60 per s) = 12 s
    assert got[3] == [False, 1, 20, 12]
    assert got[4] == -130
    assert got[6] == -6000  # an hour of its rate at most
    assert got[5]["x-ratelimit-remaining-requests"] == "0"
    assert got[5]["x-ratelimit-limit-requests"] == "3"
    # empty -> full again takes 60 s, less the milliseconds the test itself took
    assert re.fullmatch(r"1m0s|59\.9\d*s", got[5]["x-ratelimit-reset-requests"]), got[5]


# --------------------------------------------------------------------------- the Redis script

@pytest.fixture
def script(workdir: Path) -> str:
    text = (ROOT / "lua" / "infergate" / "admission" / "bucketscript.lua").read_text()
    return re.search(r"_M\.SCRIPT = \[\[\n(.*?)\]\]", text, re.S).group(1)


@pytest.mark.integration  # starts redis-server
def test_bucket_script_on_redis(redis_server, script) -> None:
    r = redis_server.client()
    run = r.register_script(script)

    def take(*buckets, mode="take"):
        ks = [b[0] for b in buckets]
        argv = [mode] + [x for b in buckets for x in b[1:]]
        res = run(keys=ks, args=argv)
        return [int(res[0])] + [float(x) for x in res[1:]]

    rpm = ("t:rpm", 2, 2 / 60, 1)
    tpm = ("t:tpm", 50, 50 / 60, 30)
    a = take(rpm, tpm)
    assert a[0] == 1 and a[1] == pytest.approx(1, abs=0.01) and a[3] == pytest.approx(20, abs=0.05)
    b = take(rpm, tpm)  # tokens short: nothing is charged
    assert b[0] == 0 and b[1] == pytest.approx(1, abs=0.01)
    assert b[4] == pytest.approx((30 - 20) / (50 / 60), abs=0.1)
    assert float(r.hget("t:rpm", "tokens")) == pytest.approx(1, abs=0.01)
    c = take(("t:rpm", 2, 2 / 60, 1))
    assert c[0] == 1 and c[1] == pytest.approx(0, abs=0.01)
    d = take(("t:rpm", 2, 2 / 60, 1))
    assert d[0] == 0 and d[2] == pytest.approx(30, abs=0.1)
    # adjust charges whatever the balance, refunds too, within [-60 x capacity, capacity]
    e = take(("t:tpm", 50, 50 / 60, 500), mode="adjust")
    assert e[0] == 1 and e[1] == pytest.approx(-480, abs=0.1)
    assert take(("t:tpm", 50, 50 / 60, 10**6), mode="adjust")[1] == -3000
    f = take(("t:tpm", 50, 50 / 60, -3050), mode="adjust")
    assert f[1] == pytest.approx(50, abs=0.1)
    f = take(("t:tpm", 50, 50 / 60, 30), mode="adjust")
    assert f[1] == pytest.approx(20, abs=0.1)
    # keys expire once they would be full again
    ttl_ms = r.pttl("t:tpm")
    assert 0 < ttl_ms <= math.ceil(30 / (50 / 60) * 1000) + 1000


def test_the_proxied_api_paths_may_have_deadlines_of_their_own(workdir: Path) -> None:
    routes = {"/v1/audio/transcriptions": {"request_ms": 600000}, "/v1/responses":
              {"request_ms": 120000, "stream_idle_ms": 60000}, "/tokenize": {"request_ms": 500}}
    s = settings_from_dict({"deadlines": {"routes": routes}})
    r = render_nginx(s, workdir / "out", listen="127.0.0.1:18141")
    doc, spec = rendered_options(r.http_conf.read_text())
    got = lua_eval(workdir, f"""
            local config = require("infergate.core.config")
            assert(config.init({lua_string(json.dumps(doc))}, {lua_string(json.dumps(spec))}))
            return config.get().deadlines.routes
    """)
    assert got == {"/v1/audio/transcriptions": {"request_ms": 600000, "stream_idle_ms": 30000},
                   "/v1/responses": {"request_ms": 120000, "stream_idle_ms": 60000},
                   "/tokenize": {"request_ms": 500, "stream_idle_ms": 30000}}
    with pytest.raises(ConfigError, match="unknown path '/v1/foo'"):
        settings_from_dict({"deadlines": {"routes": {"/v1/foo": {"request_ms": 5}}}})
