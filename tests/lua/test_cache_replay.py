"""Capture and replay logic in Lua (run inside nginx): SSE reassembly with reasoning and
tool calls, completeness rules, UTF-8-safe splitting, the JSON encoder, the SSE replay
read back by Python, and validation of the cache options."""

from __future__ import annotations

import json
import random

from support.stack import lua_eval

from controlplane.edge.options import option_spec


def run(workdir, code: str, data=None):
    path = workdir / f"in-{random.randrange(10**9)}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return lua_eval(workdir, f"""
        local cjson = require("cjson.safe")
        local f = io.open("{path}", "rb"); local input = cjson.decode(f:read("*a")); f:close()
        local replay = require("infergate.cache.replay")
        local capture = require("infergate.cache.capture")
        {code}
    """)


def sse(*events) -> str:
    out = []
    for e in events:
        out.append("data: " + (e if isinstance(e, str) else json.dumps(e)) + "\n\n")
    return "".join(out)


def chunk(delta=None, finish=None, **top):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **top}


STREAM = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "Think "}),
    chunk({"reasoning_content": "first."}),
    chunk({"content": "Héllo "}),
    chunk({"content": "wörld"}),
    chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "get_", "arguments": "{\"ci"}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": "ty\": 1}"}}]}),
    chunk({}, "tool_calls"),
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
     "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                              "prompt_tokens_details": {"cached_tokens": 0}}},
    "[DONE]",
).replace("\n\n", "\r\n\r\n", 1)  # CRLF line ends are read too


def test_stream_is_reassembled_with_reasoning_tool_calls_and_usage(workdir) -> None:
    out = run(workdir, """
        local comp, err = capture.completion({ sse = true, kind = "chat" }, input)
        if not comp then error(err) end
        return cjson.decode(replay.encode(comp))
    """, STREAM)
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == "Héllo wörld"
    assert msg["reasoning_content"] == "Think first."
    assert msg["tool_calls"] == [{"id": "call_1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": "{\"city\": 1}"}}]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["usage"]["total_tokens"] == 10
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert out["object"] == "chat.completion" and out["model"] == "m"


def test_a_streamed_tool_call_without_text_has_null_content(workdir) -> None:
    """vLLM opens a stream with an empty content delta, tool calls too; its plain answer
    to a tool call has "content": null, and so has the stored one. A stream of empty
    content only, without tool calls, is an empty answer."""
    tool_only = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"), "[DONE]")
    empty = sse(chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), "[DONE]")
    for text, content in ((tool_only, None), (empty, "")):
        out = run(workdir, """
            local comp, err = capture.completion({ sse = true, kind = "chat" }, input)
            if not comp then error(err) end
            return cjson.decode(replay.encode(comp))
        """, text)
        msg = out["choices"][0]["message"]
        assert "content" in msg and msg["content"] == content


def test_refusal_reasoning_name_and_stop_reason_survive_a_hit(workdir) -> None:
    """What a node sends is what a hit replays: a streamed refusal (content null beside
    it, as in a plain answer), the reasoning under the name the node gave it (newer
    vLLM: "reasoning"), vLLM's stop_reason; both when stored from a stream and from a
    plain answer, replayed as JSON and as a stream."""
    stream = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "Weigh it."}),
        chunk({"refusal": "I can't "}),
        chunk({"refusal": "help."}),
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]},
        "[DONE]")
    plain = json.dumps({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END",
                                     "message": {"role": "assistant", "content": None,
                                                 "reasoning": "Weigh it.",
                                                 "refusal": "I can't help."}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                  "total_tokens": 3}})
    out = run(workdir, """
        local res = {}
        for i, text in ipairs(input) do
            local comp, err = capture.completion({ sse = i == 1, kind = "chat" }, text)
            if not comp then error(err) end
            local stored = replay.encode(comp)
            local again = replay.decode_stored(stored, "chat")
            res[i] = { json = cjson.decode(stored),
                       sse = replay.sse(again, "chat", "chatcmpl-x", 42, false) }
        end
        return res
    """, [stream, plain])
    for got in out:
        ch = got["json"]["choices"][0]
        assert ch["message"]["content"] is None
        assert ch["message"]["refusal"] == "I can't help."
        assert ch["message"]["reasoning"] == "Weigh it."
        assert "reasoning_content" not in ch["message"]
        assert ch["stop_reason"] == "END"
        chunks = [json.loads(e[len("data: "):]) for e in got["sse"].split("\n\n")
                  if e and e != "data: [DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("refusal", "") for d in deltas) == "I can't help."
        assert "".join(d.get("reasoning", "") for d in deltas) == "Weigh it."
        assert not any(d.get("content") for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"][0]["stop_reason"] == "END"


def test_incomplete_or_failed_answers_are_refused(workdir) -> None:
    cases = {
        "no_done": STREAM.replace("data: [DONE]\n\n", ""),
        "length": sse(chunk({"role": "assistant", "content": "cut"}), chunk({}, "length"), "[DONE]"),
        "length_usage": sse(chunk({"role": "assistant", "content": "cut"}), chunk({}, "length"),
                            {"id": "chatcmpl-1", "choices": [],
                             "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                       "total_tokens": 3}}, "[DONE]"),
        "filtered": sse(chunk({"role": "assistant", "content": "x"}), chunk({}, "content_filter"),
                        "[DONE]"),
        "error_event": sse(chunk({"content": "a"}), {"error": {"message": "boom"}}, "[DONE]"),
        "json_error": json.dumps({"error": {"message": "bad"}}),
        "no_choices": json.dumps({"id": "x", "choices": []}),
        "not_json": "<html>oops</html>",
        "two_choices": json.dumps({"id": "x", "object": "chat.completion", "created": 1,
                                   "model": "m", "choices": [
            {"index": i, "message": {"role": "assistant", "content": "c%d" % i},
             "finish_reason": "stop"} for i in (0, 1)]}),
    }
    out = run(workdir, """
        local res = {}
        for name, text in pairs(input) do
            local is_sse = name ~= "json_error" and name ~= "no_choices" and name ~= "not_json"
                and name ~= "two_choices"
            local comp, err = capture.completion({ sse = is_sse, kind = "chat" }, text)
            res[name] = comp and "stored" or err
        end
        -- the same answer to a request that set max_tokens 1: without usage nothing
        -- tells it from a cut by the node's context; with usage showing 1 token it is whole
        local comp, err = capture.completion({ sse = true, kind = "chat", max_tokens = 1 },
                                             input.length)
        res.length_max_tokens = comp and "stored" or err
        comp, err = capture.completion({ sse = true, kind = "chat", max_tokens = 1 },
                                       input.length_usage)
        res.length_usage = comp and "stored" or err
        return res
    """, cases)
    assert out["no_done"] == "stream ended without [DONE]"
    # cut by max_tokens: the complete answer for that max_tokens (part of the key); without
    # one, "length" is the node's own limit (its context), not the whole answer
    assert out["length_usage"] == "stored"
    assert out["length_max_tokens"] == "length without usage: maybe cut by the node's limit"
    assert out["length"] == "cut by the node's limit (no max_tokens)"
    assert out["filtered"] == "finish_reason content_filter"
    assert out["error_event"] == "stream carried an error"
    assert out["json_error"] == "answer is an error"
    assert out["no_choices"] == "answer has no choices"
    assert out["not_json"] == "answer is not JSON"
    # only one choice is asked for (n > 1 bypasses): two are a node's mistake, not stored
    assert out["two_choices"] == "answer has 2 choices"


def test_text_completion_json_and_stream(workdir) -> None:
    plain = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "text": "the sea", "finish_reason": "stop",
                                     "logprobs": None}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})
    stream = sse({"id": "cmpl-1", "choices": [{"index": 0, "text": "the ", "finish_reason": None}]},
                 {"id": "cmpl-1", "choices": [{"index": 0, "text": "sea", "finish_reason": "stop"}]},
                 "[DONE]")
    out = run(workdir, """
        local a = capture.completion({ sse = false, kind = "text" }, input[1])
        local b = capture.completion({ sse = true, kind = "text" }, input[2])
        return { a.choices[1].text, b.choices[1].text, a.object, b.usage == cjson.null }
    """, [plain, stream])
    assert out == ["the sea", "the sea", "text_completion", True]


def test_replayed_stream_parses_back_to_the_same_answer(workdir) -> None:
    text = "数据库缓存 " * 40 + "é" * 50
    comp = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": text, "reasoning_content": "why",
                "tool_calls": [{"id": "t", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    out = run(workdir, """
        local comp = replay.decode_stored(cjson.encode(input), "chat")
        return { replay.sse(comp, "chat", "chatcmpl-x", 42, true),
                 replay.sse(comp, "chat", "chatcmpl-x", 42, false) }
    """, comp)
    with_usage, without = out
    events = [e[len("data: "):] for e in with_usage.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == "chatcmpl-x" and c["created"] == 42 for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    pieces = [p for p in pieces if p]
    assert len(pieces) > 2 and "".join(pieces) == text  # split, never inside a character
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") == [
        {"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 3
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
            and c["choices"][0]["finish_reason"]] == ["stop"]
    assert '"usage"' not in without


def test_encoder_keeps_arrays_objects_and_numbers(workdir) -> None:
    out = run(workdir, """
        local A, O = replay.ARRAY_MT, replay.OBJECT_MT
        return replay.encode({ a = setmetatable({}, A), o = setmetatable({}, O), n = 0.1,
                               i = 3, big = 1e300, s = "q\\"\\n\\1/", list = { 1, 2 } })
    """)
    assert json.loads(out) == {"a": [], "o": {}, "n": 0.1, "i": 3, "big": 1e300,
                               "s": "q\"\n\x01/", "list": [1, 2]}
    assert '"a":[]' in out and '"o":{}' in out


def test_cache_options_are_validated(workdir) -> None:
    bad = [{"bogus": 1}, {"ttl_s": 0}, {"min_similarity": 2}, {"min_similarity_models": {"m": "x"}},
           {"coalesce": "yes"}]
    # the [cache] options are checked with the others, against the rendered spec
    out = run(workdir, """
        local config = require("infergate.core.config")
        local cache = require("infergate.cache.lookup")
        local res = {}
        for i, o in ipairs(input.cases) do
            o.enabled = false
            local ok, err = config.init({ cache = o }, input.spec)
            res[i] = ok and "ok" or err
        end
        assert(config.init({ cache = { enabled = false, min_similarity = 0 } }, input.spec))
        local ok = cache.init()
        res[#res + 1] = ok and cache.options().min_similarity
        return res
    """, {"cases": bad, "spec": option_spec()})
    assert out[0] == "cache.bogus: unknown option"
    assert out[1] == "cache.ttl_s: 0 is below the minimum 1"
    assert out[2] == "cache.min_similarity: 2 is above the maximum 1"
    assert out[3] == 'cache.min_similarity_models["m"]: must be a number'
    assert out[4] == "cache.coalesce: must be a boolean"
    assert out[5] == 0



def test_a_hit_splices_the_stored_bytes(workdir) -> None:
    # the entry keeps the body without id/created: a non-streaming hit writes the fresh
    # id and created in front of it, the same JSON as encoding the completion again
    answer = {"id": "chatcmpl-node", "object": "chat.completion", "created": 7, "model": "m",
              "choices": [{"index": 0, "finish_reason": "length",
                           "message": {"role": "assistant", "content": "caf\u00e9 \"q\" \\ {x}"}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    out = run(workdir, """
        local comp = assert(replay.normalize(input, "chat"))
        local tail = assert(replay.tail(comp))
        local spliced = replay.splice(tail, "chatcmpl-new", 1700000000)
        comp.id, comp.created = "chatcmpl-new", 1700000000
        local lookup = require("infergate.cache.lookup")
        local doc = replay.encode({ body = replay.encode(comp), tail = tail, usage = true })
        local plain = lookup.parse_entry(doc, { stream = false, kind = "chat" })
        local stream = lookup.parse_entry(doc, { stream = true, kind = "chat" })
        local nousage = lookup.parse_entry(replay.encode({ body = replay.encode(comp), tail = tail,
                                                           usage = false }),
                                           { stream = false, kind = "chat" })
        return { spliced = spliced, encoded = replay.encode(comp), tail_used = plain.tail ~= nil,
                 stream_decoded = stream.comp ~= nil and stream.tail == nil,
                 nousage = nousage == nil }
    """, answer)
    assert json.loads(out["spliced"]) == json.loads(out["encoded"])
    assert json.loads(out["spliced"])["id"] == "chatcmpl-new"
    assert out["tail_used"] and out["stream_decoded"]
    assert out["nousage"]  # a stored answer without usage never answers a non-streaming request


def test_a_stream_hit_fills_a_rendered_replay(workdir) -> None:
    answer = {"id": "chatcmpl-node", "object": "chat.completion", "created": 7, "model": "m",
              "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant",
                                       "content": 'say "id":"@@IGID@@" and "created":-7, ' * 3}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    out = run(workdir, """
        local comp = assert(replay.normalize(input, "chat"))
        local text = replay.encode(comp)
        local tpl = replay.sse_template(text, comp, "chat", true)
        return { filled = replay.sse_fill(tpl, "chatcmpl-new", 1700000000),
                 direct = replay.sse(comp, "chat", "chatcmpl-new", 1700000000, true),
                 cached = replay.sse_cached(text, "chat", true) == tpl,
                 other = replay.sse_cached(text, "chat", false) == nil }
    """, answer)
    # the marks inside the content are escaped text and stay as they were
    assert out["filled"] == out["direct"]
    assert out["cached"] and out["other"]


# ----------------------------------------------------------------------------- usage of streams


def test_stream_body_asks_for_usage_and_keeps_every_other_byte(workdir) -> None:
    plain = '{"model": "m", "stream": true,\n "messages": [{"role": "user", "content": "x"}]}'
    with_opts = ('{"model":"m","stream":true,"stream_options":{"include_usage":false,'
                 '"continuous_usage_stats":true},"tools":[],"messages":[]}')
    null_opts = '{"stream": true, "stream_options": null, "n": 1}'
    # a key ending in an escaped quote + stream_options is not the member
    tricky = ('{"messages":[{"role":"user","content":"\\"stream_options\\": 1"}],'
              '"meta":{"he said \\"stream_options":2},"stream":true,"stream_options":{}}')
    twice = '{"stream":true,"stream_options":{},"metadata":{"stream_options":{}}}'
    braces = '{"stream":true,"stream_options":{"x":"}"}}'
    out = run(workdir, """
        local lookup = require("infergate.cache.lookup")
        local res = {}
        for i, text in ipairs(input) do
            local so = cjson.decode(text).stream_options
            local body, err = lookup.with_usage(text, so)
            res[i] = body or ("error: " .. err)
        end
        return res
    """, [plain, with_opts, null_opts, tricky, twice, braces])
    assert out[0] == ('{"stream_options":{"include_usage":true},"model": "m", "stream": true,\n'
                      ' "messages": [{"role": "user", "content": "x"}]}')
    b = json.loads(out[1])
    assert b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert out[1].endswith(',"tools":[],"messages":[]}')  # [] stays [] (not re-encoded)
    assert out[2] == '{"stream": true, "stream_options": {"include_usage":true}, "n": 1}'
    t = json.loads(out[3])
    assert t["stream_options"] == {"include_usage": True}
    assert t["messages"][0]["content"] == '"stream_options": 1' and t["meta"] == {
        'he said "stream_options': 2}
    assert out[4] == "error: stream_options not found once"
    assert out[5].startswith("error: ")


USAGE_STREAM = sse(
    chunk({"role": "assistant", "content": ""}, usage=None),
    chunk({"content": "choices [] \"usage\": {x}"}, usage=None),
    chunk({}, "stop", usage=None),
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
     "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    "[DONE]",
)


#: Lua: every way reads can split each stream of `input` (two reads at every cut, one
#: read per byte, the whole then an empty last read) -> name: the outputs seen.
SPLIT_READS = """
        local res = {}
        for name, text in pairs(input) do
            local outs = {}
            -- every split into two reads, one read per byte, an empty last read
            for cut = 0, #text do
                local st = {}
                local a = capture.strip_usage(st, text:sub(1, cut), false)
                local b = capture.strip_usage(st, text:sub(cut + 1), true)
                outs[(a or "") .. (b or "")] = true
            end
            local st, parts = {}, {}
            for i = 1, #text do
                parts[#parts + 1] = capture.strip_usage(st, text:sub(i, i), i == #text) or ""
            end
            outs[table.concat(parts)] = true
            local st2 = {}
            local a = capture.strip_usage(st2, text, false)
            outs[(a or "") .. (capture.strip_usage(st2, "", true) or "")] = true
            local list = {}
            for k in pairs(outs) do list[#list + 1] = k end
            res[name] = list
        end
        return res
"""


def test_usage_chunk_is_stripped_wherever_the_reads_split_the_stream(workdir) -> None:
    compact = USAGE_STREAM.replace('"choices": []', '"choices":[]')
    crlf = USAGE_STREAM.replace("\n\n", "\r\n\r\n")
    # an event with empty choices but no usage (e.g. prompt filter results) stays
    other = sse({"id": "x", "choices": [], "prompt_filter_results": []}) + USAGE_STREAM
    out = run(workdir, SPLIT_READS,
              {"spaced": USAGE_STREAM, "compact": compact, "crlf": crlf, "other": other})
    for name, text in (("spaced", USAGE_STREAM), ("compact", compact), ("crlf", crlf),
                       ("other", other)):
        sep = "\r\n\r\n" if name == "crlf" else "\n\n"
        events = text.split(sep)
        want = sep.join(e for e in events if not ('"usage": {' in e or '"usage":{' in e))
        assert out[name] == [want], name
        assert "completion_tokens" not in want and want.endswith("data: [DONE]" + sep)
    assert '"prompt_filter_results"' in out["other"][0]


TIMINGS = {"prompt_n": 3, "prompt_ms": 1.5, "predicted_n": 2, "predicted_per_second": 40.25}
# llama-server's last chunks with include_usage: the finish chunk, then the usage-only
# chunk carrying "timings"; without include_usage the timings ride on the finish chunk.
LLAMA_USAGE_STREAM = sse(
    chunk({"content": "Hi"}),
    chunk({}, "stop"),
    {"choices": [], "created": 5, "id": "chatcmpl-1", "model": "m",
     "object": "chat.completion.chunk",
     "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
     "timings": TIMINGS},
    "[DONE]",
)


def test_stripped_usage_chunk_leaves_its_timings_on_the_finish_chunk(workdir) -> None:
    crlf = LLAMA_USAGE_STREAM.replace("\n\n", "\r\n\r\n")
    # no usage chunk at all (a node that ignored include_usage): the finish chunk is
    # only held until the next event, nothing is added
    plain = sse(chunk({"content": "Hi"}), chunk({}, "stop"), "[DONE]")
    # a stream that ends right after its finish chunk still sends it
    cut = sse(chunk({"content": "Hi"}), chunk({}, "length"))
    out = run(workdir, SPLIT_READS, {"spaced": LLAMA_USAGE_STREAM, "crlf": crlf, "plain": plain, "cut": cut})
    for name in ("spaced", "crlf"):
        assert len(out[name]) == 1, name
        sep = "\r\n\r\n" if name == "crlf" else "\n\n"
        events = [e[len("data: "):] for e in out[name][0].split(sep) if e]
        assert events[-1] == "[DONE]" and len(events) == 3, name
        fin = json.loads(events[1])
        assert fin["choices"][0]["finish_reason"] == "stop"
        assert fin["timings"] == TIMINGS and "usage" not in fin
    assert out["plain"] == [plain]
    assert out["cut"] == [cut]


def test_semantic_hit_usage_is_scaled_by_the_prompt_length(workdir) -> None:
    u = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
         "prompt_tokens_details": {"cached_tokens": 80}}
    out = run(workdir, """
        local s = replay.scaled_usage(input, 50, 100)
        local same = replay.scaled_usage(input, 100, 100)
        local tiny = replay.scaled_usage(input, 1, 1000)
        local none = replay.scaled_usage(input, 0, 100)
        return { replay.encode(s), same == nil, tiny.prompt_tokens, none == nil,
                 replay.scaled_usage(input, 30, 20).prompt_tokens_details.cached_tokens }
    """, u)
    assert json.loads(out[0]) == {"prompt_tokens": 50, "completion_tokens": 20,
                                  "total_tokens": 70, "prompt_tokens_details": {"cached_tokens": 50}}
    assert out[1:] == [True, 1, True, 80]
