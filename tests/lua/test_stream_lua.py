"""The stream relay's pure parts (lua/infergate/stream/): SSE events and what they are
(content, role-only, usage, in-band errors), chunked bodies read piece by piece, the
continuation bodies each engine gets, and the splice of several answers into one client
stream. Run in nginx's init_by_lua (support.stack.lua_eval)."""

from __future__ import annotations

import json

from support.stack import lua_eval


def lua_list(items: list[str]) -> str:
    """A Lua array of the strings ``items`` (JSON string literals are Lua literals)."""
    return "{" + ", ".join(json.dumps(i) for i in items) + "}"

ROLE = ('data: {"id":"x1","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        '"finish_reason":null}]}\n\n')
TOKEN = 'data: {"id":"x1","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'


def test_sse_events_are_split_and_classified(workdir) -> None:
    text = (ROLE + ": keep-alive\n\n" + TOKEN.replace("\n\n", "\r\n\r\n")
            + 'data: {"id":"x1","choices":[],"usage":{"completion_tokens":1}}\n\n'
            + 'data: {"error":{"message":"boom"}}\n\n'
            + 'event: error\ndata: {"message":"x"}\n\n'
            + 'data: {"id":"c","choices":[{"index":0,"text":" more","finish_reason":"length"}]}\n\n'
            + "data: [DONE]\n\ndata: {\"partial")
    out = lua_eval(workdir, f"""
        local sse = require("infergate.stream.sse")
        local st, kinds, texts = sse.new(), {{}}, {{}}
        local text = {json.dumps(text)}
        for i = 1, #text, 7 do   -- pieces of 7 bytes: events cut anywhere
            for _, ev in ipairs(sse.feed(st, text:sub(i, i + 6))) do
                local c = sse.classify(ev)
                kinds[#kinds + 1] = c.kind
                texts[#texts + 1] = (c.content or "") .. "|" .. (c.finish or "")
            end
        end
        return {{kinds = kinds, texts = texts, rest = st.buf}}
    """)
    assert out["kinds"] == ["meta", "comment", "content", "usage", "error", "error", "content",
                            "done"]
    assert out["texts"][2] == "Hi|" and out["texts"][6] == " more|length"
    assert out["rest"] == 'data: {"partial'


def test_chunked_bodies_are_read_across_any_cut(workdir) -> None:
    body = "5\r\nhello\r\n1a\r\n" + "x" * 26 + "\r\n0\r\n\r\n"
    out = lua_eval(workdir, f"""
        local http = require("infergate.stream.http")
        local body = {json.dumps(body)}
        local res = {{}}
        for cut = 1, #body do
            local head, got = {{chunked = true, raw = ""}}, {{}}
            for _, piece in ipairs({{body:sub(1, cut), body:sub(cut + 1)}}) do
                head.raw = head.raw .. piece
                got[#got + 1] = assert(http._dechunk(head))
            end
            res[#res + 1] = table.concat(got) .. (head.done and "$" or "")
        end
        local bad = {{chunked = true, raw = "zz\\r\\n"}}
        return {{res = res, bad = select(2, http._dechunk(bad))}}
    """)
    assert set(out["res"]) == {"hello" + "x" * 26 + "$"}
    assert out["bad"] == "bad chunk"


def _continuation(workdir, body: dict, path: str, partial: str, produced: int, how):
    how_lua = json.dumps(how) if how else "nil"
    return lua_eval(workdir, f"""
        local splice = require("infergate.stream.splice")
        local cjson = require("cjson.safe")
        local b, err = splice.continuation({json.dumps(json.dumps(body))}, "{path}",
                                           {json.dumps(partial)}, {produced}, {how_lua})
        return {{body = b and cjson.decode(b) or nil, raw = b, err = err}}
    """)


def test_continuation_bodies_follow_each_engine(workdir) -> None:
    chat = {"model": "m", "stream": True, "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}]}
    vllm = _continuation(workdir, chat, "/v1/chat/completions", "Hello wor", 3,
                         "continue_final_message")["body"]
    assert vllm["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert vllm["continue_final_message"] is True and vllm["add_generation_prompt"] is False
    assert vllm["max_tokens"] == 7 and vllm["stream"] is True
    llama = _continuation(workdir, chat, "/v1/chat/completions", "Hello", 3, "prefill")["body"]
    assert llama["messages"][-1]["content"] == "Hello" and "continue_final_message" not in llama
    # the client's own prefill is extended, not followed by a second assistant message
    own = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "Sure: "}]}
    ext = _continuation(workdir, own, "/v1/chat/completions", "one", 1, "prefill")["body"]
    assert len(ext["messages"]) == 2 and ext["messages"][-1]["content"] == "Sure: one"
    res = _continuation(workdir, {"prompt": "Once [] \"[]\"", "max_tokens": 5, "stop": []},
                        "/v1/completions", " upon", 1, None)
    comp = res["body"]
    assert '"stop":[]' in res["raw"], "an empty array stays an array"
    assert comp["prompt"] == 'Once [] "[]" upon'
    assert comp["max_tokens"] == 4
    assert _continuation(workdir, chat, "/v1/chat/completions", "x", 10, "prefill")["err"] == "done"
    assert "cannot continue" in _continuation(workdir, chat, "/v1/chat/completions", "x", 1,
                                              None)["err"]


def test_later_legs_are_spliced_into_the_first_stream(workdir) -> None:
    out = lua_eval(workdir, f"""
        local sse = require("infergate.stream.sse")
        local splice = require("infergate.stream.splice")
        local cjson = require("cjson.safe")
        local o = splice.new_out()
        local sent = {{}}
        local function feed(text, leg)
            local p = splice.rewrite(o, sse.classify(text), text, leg)
            if p then sent[#sent + 1] = p end
        end
        feed({json.dumps(ROLE)}, 1)
        feed({json.dumps(TOKEN)}, 1)
        o.usage_done = o.produced            -- the first node breaks: a continuation
        feed({json.dumps(ROLE.replace("x1", "y2"))}, 2)
        feed({json.dumps(TOKEN.replace("x1", "y2").replace("Hi", " there"))}, 2)
        feed('data: {{"id":"y2","choices":[],"usage":{{"completion_tokens":1,"total_tokens":4}}}}\\n\\n', 2)
        local ids, usage = {{}}, nil
        for i, s in ipairs(sent) do
            local obj = cjson.decode(s:match("^data: (.-)\\n\\n$"))
            ids[i] = obj.id
            usage = obj.usage or usage
        end
        local fin = cjson.decode(splice.finish_event(o, "/v1/chat/completions", "length")
                                 :match("^data: (.-)\\n\\n$"))
        return {{n = #sent, ids = ids, usage = usage, partial = splice.partial(o), fin = fin,
                 last = sent[#sent]}}
    """)
    assert out["n"] == 4 and set(out["ids"]) == {"x1"}  # the second role chunk dropped
    assert out["partial"] == "Hi there"
    assert out["usage"] == {"completion_tokens": 2, "total_tokens": 5}
    assert '"choices":[]' in out["last"], "an empty array stays an array"
    assert out["fin"]["id"] == "x1"
    assert out["fin"]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]


def test_a_stream_of_several_choices_passes_whole_on_its_first_leg(workdir) -> None:
    """n = 2 as llama-server streams it: a role chunk and a finish chunk per choice; every
    event of the first leg reaches the client (a second role chunk, or choice 1's finish
    chunk, is no later leg's repeat)."""
    def ev(index: int, delta: dict, finish: str | None = None) -> str:
        return "data: " + json.dumps({"id": "x1", "choices": [
            {"index": index, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    events = [ev(0, {"role": "assistant", "content": ""}), ev(1, {"role": "assistant",
              "content": ""}), ev(0, {"content": "A"}), ev(1, {"content": "B"}),
              ev(1, {}, "length"), ev(0, {}, "stop")]
    out = lua_eval(workdir, f"""
        local sse = require("infergate.stream.sse")
        local splice = require("infergate.stream.splice")
        local o, sent = splice.new_out(), {{}}
        for _, text in ipairs({lua_list(events)}) do
            local p = splice.rewrite(o, sse.classify(text), text, 1)
            if p then sent[#sent + 1] = p end
        end
        local later = splice.rewrite(o, sse.classify({json.dumps(events[4])}),
                                     {json.dumps(events[4])}, 2)
        local role = splice.rewrite(o, sse.classify({json.dumps(events[0])}),
                                    {json.dumps(events[0])}, 2)
        return {{sent = sent, finish = o.finish, later = later or false, role = role or false}}
    """)
    assert out["sent"] == events and out["finish"] == "stop"
    assert out["later"] == events[4]        # a later leg keeps another choice's finish
    assert out["role"] is False             # and drops its role chunk, as before


def test_the_prefill_a_llama_cpp_server_repeats_is_taken_out(workdir) -> None:
    out = lua_eval(workdir, """
        local sse = require("infergate.stream.sse")
        local splice = require("infergate.stream.splice")
        local function ev(text)
            return sse.classify('data: {"id":"z","choices":[{"index":0,"delta":{"content":'
                .. require("cjson").encode(text) .. '}}]}\\n\\n')
        end
        local echo, got = "Hello wor", {}
        for _, t in ipairs({"Hello", " wor", "ld", "!"}) do
            local e = ev(t)
            echo = splice.strip_echo(e, echo)
            got[#got + 1] = e.kind .. ":" .. e.content
        end
        local other = ev("Bye")
        local left = splice.strip_echo(other, "Hello")
        return {got = got, other = other.content, left = left or "nil"}
    """)
    assert out["got"] == ["meta:", "meta:", "content:ld", "content:!"]
    assert out["other"] == "Bye" and out["left"] == "nil"
