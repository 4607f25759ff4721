-- The stored form of a captured answer (infergate.cache.capture): a JSON answer as it
-- is, or an SSE stream reassembled into one completion (role, content, reasoning
-- content, tool calls, finish reasons, usage), normalized by infergate.cache.replay.
local cjson = require("cjson.safe")
local replay = require("infergate.cache.replay")

local _M = {}

local type = type
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local concat = table.concat
local null = cjson.null

local FINISH_OK = {
    chat = { stop = true, tool_calls = true, length = true },
    text = { stop = true, length = true },
}

-- Events of an SSE text: list of data payloads (multi-line data joined by "\n").
local function sse_events(text)
    local events = {}
    local data = nil
    for line in (text .. "\n"):gmatch("([^\n]*)\n") do
        if line:sub(-1) == "\r" then
            line = line:sub(1, -2)
        end
        if line == "" then
            if data then
                events[#events + 1] = concat(data, "\n")
                data = nil
            end
        elseif line:sub(1, 5) == "data:" then
            local v = line:sub(6)
            if v:sub(1, 1) == " " then
                v = v:sub(2)
            end
            data = data or {}
            data[#data + 1] = v
        end
    end
    if data then
        events[#events + 1] = concat(data, "\n")
    end
    return events
end
_M.sse_events = sse_events

-- The tool-call deltas `tcs` of one chunk into the choice's accumulator a.
local function add_tool_calls(a, tcs)
    for _, tc in ipairs(tcs) do
        if type(tc) == "table" then
            local ti = tonumber(tc.index) or #a.tool_order
            local t = a.tools[ti]
            if not t then
                t = { name = {}, args = {} }
                a.tools[ti] = t
                a.tool_order[#a.tool_order + 1] = ti
            end
            if type(tc.id) == "string" then
                t.id = tc.id
            end
            if type(tc.type) == "string" then
                t.type = tc.type
            end
            local fn = tc["function"]
            if type(fn) == "table" then
                if type(fn.name) == "string" then
                    t.name[#t.name + 1] = fn.name
                end
                if type(fn.arguments) == "string" then
                    t.args[#t.args + 1] = fn.arguments
                end
            end
        end
    end
end

-- A chat delta d into the choice's accumulator a.
local function add_delta(a, d)
    if type(d.role) == "string" then
        a.role = d.role
    end
    -- vLLM opens every stream with {"role": ..., "content": ""},
    -- tool calls too: only text makes the content a string (else
    -- null next to tool_calls, as in vLLM's plain answers)
    local dc = d.content
    if type(dc) == "string" and dc ~= "" then
        a.content[#a.content + 1] = dc
        a.has_content = true
    end
    -- the reasoning under the name the node gives it (reasoning_content: vLLM, llama.cpp;
    -- reasoning: newer vLLM), which a hit keeps; a node sending both sends one text twice
    local r, field = d.reasoning_content, "reasoning_content"
    if type(r) ~= "string" then
        r, field = d.reasoning, "reasoning"
    end
    if type(r) == "string" then
        a.reasoning[#a.reasoning + 1] = r
        a.reasoning_field = a.reasoning_field or field
    end
    if type(d.refusal) == "string" then
        a.refusal = (a.refusal or "") .. d.refusal
    end
    if type(d.tool_calls) == "table" then
        add_tool_calls(a, d.tool_calls)
    end
end

-- One choice ch of a chunk into the accumulators (acc: index -> accumulator, order:
-- the indices in order of arrival).
local function add_choice(acc, order, ch, kind)
    local idx = tonumber(ch.index) or 0
    local a = acc[idx]
    if not a then
        a = { index = idx, content = {}, reasoning = {}, text = {}, tools = {},
              tool_order = {} }
        acc[idx] = a
        order[#order + 1] = idx
    end
    if type(ch.finish_reason) == "string" then
        a.finish_reason = ch.finish_reason
    end
    local sr = ch.stop_reason          -- vLLM: the stop string or token id that ended it
    if type(sr) == "string" or type(sr) == "number" then
        a.stop_reason = sr
    end
    if kind == "text" then
        if type(ch.text) == "string" then
            a.text[#a.text + 1] = ch.text
        end
    elseif type(ch.delta) == "table" then
        add_delta(a, ch.delta)
    end
end

-- One decoded chunk into top (the completion's top-level fields) and the accumulators.
-- Returns true, or nil, err.
local function add_chunk(top, acc, order, chunk, kind)
    if type(chunk) ~= "table" then
        return nil, "stream event is not JSON"
    end
    if chunk.error ~= nil and chunk.error ~= null then
        return nil, "stream carried an error"
    end
    top.id = top.id or chunk.id
    top.created = top.created or chunk.created
    top.model = top.model or chunk.model
    if type(chunk.system_fingerprint) == "string" then
        top.system_fingerprint = chunk.system_fingerprint
    end
    if type(chunk.usage) == "table" then
        top.usage = chunk.usage
    end
    if type(chunk.choices) == "table" then
        for _, ch in ipairs(chunk.choices) do
            if type(ch) == "table" then
                add_choice(acc, order, ch, kind)
            end
        end
    end
    return true
end

-- The choices of the completion from the accumulators, by index.
local function choices_of(acc, order, kind)
    table.sort(order)
    local choices = {}
    for i, idx in ipairs(order) do
        local a = acc[idx]
        local choice = { index = idx, finish_reason = a.finish_reason,
                         stop_reason = a.stop_reason }
        if kind == "text" then
            choice.text = concat(a.text)
        else
            local tools = {}
            table.sort(a.tool_order)
            for j, ti in ipairs(a.tool_order) do
                local t = a.tools[ti]
                tools[j] = { id = t.id, type = t.type or "function",
                             ["function"] = { name = concat(t.name), arguments = concat(t.args) } }
            end
            -- null content next to tool calls or a refusal, as in a plain answer
            choice.message = {
                role = a.role or "assistant",
                content = (a.has_content or (#tools == 0 and not a.refusal))
                    and concat(a.content) or nil,
                tool_calls = #tools > 0 and tools or nil,
                refusal = a.refusal,
            }
            if #a.reasoning > 0 then
                choice.message[a.reasoning_field] = concat(a.reasoning)
            end
        end
        choices[i] = choice
    end
    return choices
end

-- One completion (decoded-JSON shape) from the SSE text of a stream; nil, err.
function _M.reassemble(text, kind)
    local acc, order = {}, {}
    local top = {}
    local done = false
    for _, ev in ipairs(sse_events(text)) do
        if ev == "[DONE]" then
            done = true
        else
            local ok, err = add_chunk(top, acc, order, cjson.decode(ev), kind)
            if not ok then
                return nil, err
            end
        end
    end
    if not done then
        return nil, "stream ended without [DONE]"
    end
    top.choices = choices_of(acc, order, kind)
    return top
end

-- The stored form of a captured answer, or nil, reason. c.max_tokens: the request's
-- (_M.max_tokens), when it gave one.
function _M.completion(c, text)
    local o, err
    if c.sse then
        o, err = _M.reassemble(text, c.kind)
    else
        o = cjson.decode(text)
        if type(o) ~= "table" then
            err = "answer is not JSON"
        end
    end
    if not o then
        return nil, err
    end
    local comp, nerr = replay.normalize(o, c.kind)
    if not comp then
        return nil, nerr
    end
    if #comp.choices ~= 1 then
        -- only requests for one choice are stored (n > 1 bypasses): more is a node's
        -- mistake, which a hit must not repeat to every later client
        return nil, "answer has " .. #comp.choices .. " choices"
    end
    local ok = FINISH_OK[c.kind]
    for _, ch in ipairs(comp.choices) do
        if not ok[ch.finish_reason] then
            return nil, "finish_reason " .. tostring(ch.finish_reason)
        end
    end
    -- "length" with fewer tokens than the request's max_tokens, or without one: cut by
    -- the node's context (a small llama-server slot), not the whole answer for that
    -- max_tokens; without usage nothing tells the two apart (as for an answer that is
    -- not a stream, whose usage the entry needs)
    if comp.choices[1].finish_reason == "length" then
        if not c.max_tokens then
            return nil, "cut by the node's limit (no max_tokens)"
        end
        local u = comp.usage
        local written = type(u) == "table" and tonumber(u.completion_tokens)
        if not written then
            return nil, "length without usage: maybe cut by the node's limit"
        end
        if written < c.max_tokens then
            return nil, "cut at " .. written .. " tokens, short of max_tokens " .. c.max_tokens
        end
    end
    return comp
end

-- The least of a request body's max_tokens and max_completion_tokens (positive numbers),
-- or nil: the most output tokens a node writes for it.
function _M.max_tokens(body)
    if type(body) ~= "table" then
        return nil
    end
    local m
    for _, f in ipairs({ "max_tokens", "max_completion_tokens" }) do
        local v = body[f]
        if type(v) == "number" and v > 0 and (not m or v < m) then
            m = v
        end
    end
    return m
end

return _M
