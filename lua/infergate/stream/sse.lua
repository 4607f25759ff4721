-- Server-sent events of a streamed OpenAI answer (/v1/chat/completions,
-- /v1/completions), for the stream relay (infergate.stream.relay). Pure: no I/O.
--
--   new()              a parser state
--   feed(st, data)     the complete events in st's buffer after `data` ({text}, each
--                      with its closing blank line); the rest waits for more bytes
--   classify(text)     what one event is: {kind, obj, content, finish, usage, event}
--
-- Kinds:
--   "content"   a chunk that carries text for the client: choices[i].delta.content,
--               .reasoning_content, .reasoning or .refusal (chat), choices[i].text
--               (completions) non-empty, or
--               delta.tool_calls (content, but not text a continuation can append to:
--               ev.tools = true)
--   "meta"      a chunk without content: role-only first chunk (delta {"role":
--               "assistant", "content": ""}), an empty delta, a finish chunk (finish set)
--   "usage"     the usage-only chunk (choices [] and a "usage" object; stream_options
--               include_usage)
--   "error"     an in-band error: an "event: error" event, or data that is a JSON object
--               with an "error" member (vLLM and llama.cpp send {"error": {...}} after 200
--               when generation fails: vllm/entrypoints/openai/serving_chat.py
--               create_error_response in chat_completion_stream_generator; llama.cpp
--               tools/server/server.cpp handle_completions_impl, "error" data chunk)
--   "done"      data: [DONE]
--   "comment"   only ":" comment lines or no data (keep-alives)
--   "other"     data that is not a JSON object
-- content: the text of choice 0 (what a continuation appends to); finish: choice 0's
-- finish_reason or nil (other_finish: another choice ends, n > 1); usage: the "usage"
-- object when present.
local cjson = require("cjson.safe")

local _M = {}

local find = string.find
local sub = string.sub
local type = type
local concat = table.concat

function _M.new()
    return { buf = "" }
end

-- Events end with a blank line: "\n\n", "\r\n\r\n" (or a mix, "\n\r\n").
function _M.feed(st, data)
    local buf = st.buf
    if data and data ~= "" then
        buf = buf .. data
    end
    local out, pos = {}, 1
    while true do
        local s, e = find(buf, "\n\r?\n", pos)
        if not s then
            break
        end
        out[#out + 1] = sub(buf, pos, e)
        pos = e + 1
    end
    st.buf = sub(buf, pos)
    return out
end

-- The "event:" name and the joined "data:" lines of an event text.
local function fields(text)
    local data, name = nil, nil
    for line in text:gmatch("([^\n]*)\n") do
        if sub(line, -1) == "\r" then
            line = sub(line, 1, -2)
        end
        if sub(line, 1, 5) == "data:" then
            local v = sub(line, 6)
            if sub(v, 1, 1) == " " then
                v = sub(v, 2)
            end
            data = data and (data .. "\n" .. v) or v
        elseif sub(line, 1, 6) == "event:" then
            name = sub(line, 7):match("^%s*(.-)%s*$")
        end
    end
    return data, name
end
_M.fields = fields

local function nonempty(s)
    return type(s) == "string" and s ~= ""
end

-- Content text, tool calls and finish reason of choice `c`.
local function choice_parts(c)
    local delta = c.delta
    local text, tools = nil, false
    if type(delta) == "table" then
        if nonempty(delta.content) then
            text = delta.content
        elseif nonempty(delta.reasoning_content) or nonempty(delta.reasoning)
                or nonempty(delta.refusal) then
            text = ""
            tools = true -- reasoning (under either name: newer vLLM's "reasoning") and a
                         -- refusal are content for the client, not text to continue
        end
        if type(delta.tool_calls) == "table" and next(delta.tool_calls) then
            tools = true
        end
    elseif nonempty(c.text) then
        text = c.text
    end
    local finish = c.finish_reason
    if type(finish) ~= "string" then
        finish = nil
    end
    return text, tools, finish
end

function _M.classify(text)
    local data, name = fields(text)
    if name == "error" then
        return { kind = "error", event = name, obj = data and cjson.decode(data) or nil }
    end
    if not data then
        return { kind = "comment" }
    end
    if data == "[DONE]" then
        return { kind = "done" }
    end
    local obj = cjson.decode(data)
    if type(obj) ~= "table" then
        return { kind = "other" }
    end
    if obj.error ~= nil and obj.error ~= cjson.null then
        return { kind = "error", obj = obj }
    end
    local usage = type(obj.usage) == "table" and obj.usage or nil
    local choices = obj.choices
    if type(choices) ~= "table" or #choices == 0 then
        return { kind = usage and "usage" or "meta", obj = obj, usage = usage }
    end
    local ev = { kind = "meta", obj = obj, usage = usage }
    local parts = {}
    for i = 1, #choices do
        local c = choices[i]
        if type(c) == "table" then
            local t, tools, finish = choice_parts(c)
            if t or tools then
                ev.kind = "content"
                ev.tools = ev.tools or tools
                parts[#parts + 1] = t
            end
            if finish and (c.index == nil or c.index == 0) then
                ev.finish = finish
            elseif finish then
                ev.other_finish = true -- another choice (n > 1) ends: not a role chunk
            end
        end
    end
    if #choices > 1 then
        ev.many = true
    end
    ev.content = concat(parts)
    return ev
end

return _M
