-- Cached answers: their stored form and how a hit is served (JSON or SSE replay).
--
--   local replay = require("infergate.cache.replay")
--   local comp, err = replay.normalize(decoded_answer, "chat")   -- "chat" | "text"
--   local text = replay.encode(comp)                               -- stored entry body
--   replay.send(req_state, cache_state, comp, created, "exact", 1.0)  -- answers and exits
--
-- Stored form (the entry's "body"): an OpenAI completion reduced to what a client reads,
--   chat: {"id", "object": "chat.completion", "created", "model", "system_fingerprint"?,
--          "choices": [{"index", "message": {"role", "content", "reasoning_content"?,
--                       "reasoning"?, "tool_calls"?, "refusal"?}, "logprobs": null,
--                       "finish_reason", "stop_reason"?}],
--          "usage": {...} | null}
--   text: {"id", "object": "text_completion", "created", "model", "choices": [{"index",
--          "text", "logprobs": null, "finish_reason", "stop_reason"?}], "usage": {...} | null}
-- A hit gets a fresh "id" and "created". The entry also keeps "tail" (tail(comp): the
-- body's JSON text without "id" and "created" and without its opening brace) and "usage"
-- (whether the body has usage): a non-streaming hit is then answered by splice(), which
-- writes the fresh "id" and "created" in front of the stored bytes, with no JSON decoded
-- or encoded. A streaming request gets an SSE replay: a role
-- chunk, the reasoning, content and refusal split into several chunks (on UTF-8
-- character boundaries), tool calls, the finish chunk, a usage chunk when the request
-- asked for stream_options.include_usage, then "data: [DONE]".
--
-- Debian's lua-cjson (2.1.0) decodes [] and {} alike and has no empty-array marker, so
-- answers are written by infergate.core.jsonenc (default spelling): tables with ARRAY_MT are
-- arrays, with OBJECT_MT objects, other tables arrays when they are non-empty sequences.
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local jsonenc = require("infergate.core.jsonenc")

local _M = {}

local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local floor = math.floor
local format = string.format
local concat = table.concat
local byte = string.byte
local sub = string.sub
local null = cjson.null
local seq_len = jsonenc.seq_len

_M.ARRAY_MT = jsonenc.ARRAY_MT
_M.OBJECT_MT = jsonenc.OBJECT_MT
local ARRAY_MT, OBJECT_MT = _M.ARRAY_MT, _M.OBJECT_MT

local function arr(t)
    return setmetatable(t or {}, ARRAY_MT)
end

local function obj(t)
    return setmetatable(t or {}, OBJECT_MT)
end

-- ------------------------------------------------------------------ JSON encoder

-- JSON text of a value (see the ARRAY_MT / OBJECT_MT rules above); nil, err on failure.
function _M.encode(v)
    return jsonenc.encode(v)
end

-- ------------------------------------------------------------------ stored form

local function str(v)
    return type(v) == "string" and v or nil
end

local function int(v, default)
    if type(v) == "number" and v == v then
        return floor(v)
    end
    return default
end

local function is_seq(t)
    return type(t) == "table" and seq_len(t) ~= nil
end

-- usage: numbers kept, one level of nested objects of numbers (e.g. prompt_tokens_details)
local function norm_usage(u)
    if type(u) ~= "table" then
        return null
    end
    local out = obj()
    for k, v in pairs(u) do
        if type(k) == "string" then
            if type(v) == "number" then
                out[k] = v
            elseif type(v) == "table" and not is_seq(v) then
                local sub_t = obj()
                for k2, v2 in pairs(v) do
                    if type(k2) == "string" and type(v2) == "number" then
                        sub_t[k2] = v2
                    end
                end
                out[k] = sub_t
            end
        end
    end
    return out
end

-- The usage of a stored answer served to a prompt of `chars` characters when the stored
-- prompt had `stored_chars` (a semantic hit: another prompt, and the edge cannot
-- tokenize): prompt_tokens estimated as the stored prompt_tokens x chars / stored_chars
-- (rounded, at least 1), total_tokens moved by as much, prompt_tokens_details.cached_tokens
-- at most the estimate; completion_tokens as stored. nil when there is nothing to scale
-- or the figures stay the same.
function _M.scaled_usage(u, chars, stored_chars)
    if type(u) ~= "table" or type(u.prompt_tokens) ~= "number" or type(chars) ~= "number"
        or type(stored_chars) ~= "number" or chars <= 0 or stored_chars <= 0 then
        return nil
    end
    local pt = u.prompt_tokens
    local est = floor(pt * chars / stored_chars + 0.5)
    if est < 1 then
        est = 1
    end
    if est == pt then
        return nil
    end
    local out = obj()
    for k, v in pairs(u) do
        out[k] = v
    end
    out.prompt_tokens = est
    if type(u.total_tokens) == "number" then
        out.total_tokens = u.total_tokens + est - pt
    end
    local d = u.prompt_tokens_details
    if type(d) == "table" and type(d.cached_tokens) == "number" and d.cached_tokens > est then
        local nd = obj()
        for k, v in pairs(d) do
            nd[k] = v
        end
        nd.cached_tokens = est
        out.prompt_tokens_details = nd
    end
    return out
end

local function norm_tool_calls(tcs)
    if type(tcs) ~= "table" then
        return nil
    end
    local n = seq_len(tcs)
    if not n or n == 0 then
        return nil
    end
    local out = arr()
    for i = 1, n do
        local tc = tcs[i]
        if type(tc) ~= "table" then
            return nil, "tool call is not an object"
        end
        local fn = type(tc["function"]) == "table" and tc["function"] or {}
        out[i] = obj({
            id = str(tc.id) or "",
            type = str(tc.type) or "function",
            ["function"] = obj({ name = str(fn.name) or "", arguments = str(fn.arguments) or "" }),
        })
    end
    return out
end

-- The stored form of a decoded completion ("chat" or "text"); nil, err when it is not a
-- completion (no choices, an error object, ...).
function _M.normalize(o, kind)
    if type(o) ~= "table" then
        return nil, "answer is not a JSON object"
    end
    if o.error ~= nil and o.error ~= null then
        return nil, "answer is an error"
    end
    local choices = o.choices
    local n = type(choices) == "table" and seq_len(choices)
    if not n or n == 0 then
        return nil, "answer has no choices"
    end
    local out = obj({
        id = str(o.id) or "",
        object = kind == "chat" and "chat.completion" or "text_completion",
        created = int(o.created, 0),
        model = str(o.model) or "",
        system_fingerprint = str(o.system_fingerprint),
        usage = norm_usage(o.usage),
        choices = arr(),
    })
    for i = 1, n do
        local c = choices[i]
        if type(c) ~= "table" then
            return nil, "choice is not an object"
        end
        local oc = obj({ index = int(c.index, i - 1), logprobs = null,
                         finish_reason = str(c.finish_reason) or null })
        local sr = c.stop_reason           -- vLLM's, kept as sent (a string, an id, null)
        if type(sr) == "string" or type(sr) == "number" or sr == null then
            oc.stop_reason = sr
        end
        if kind == "chat" then
            local m = type(c.message) == "table" and c.message or {}
            local content = m.content
            if type(content) ~= "string" then
                content = null
            end
            local tcs, terr = norm_tool_calls(m.tool_calls)
            if terr then
                return nil, terr
            end
            oc.message = obj({
                role = str(m.role) or "assistant",
                content = content,
                reasoning_content = str(m.reasoning_content),
                reasoning = str(m.reasoning),
                tool_calls = tcs,
                refusal = str(m.refusal),
            })
        else
            oc.text = str(c.text) or ""
        end
        out.choices[i] = oc
    end
    return out
end

-- Re-applies the array/object marks to a stored body decoded by cjson.
function _M.decode_stored(text, kind)
    local o = cjson.decode(text)
    if type(o) ~= "table" then
        return nil, "stored body is not JSON"
    end
    return _M.normalize(o, kind)
end

-- The body's JSON text without "id" and "created" and without its opening "{" (the
-- entry's "tail"); nil, err when it cannot be encoded.
function _M.tail(comp)
    local id, created = comp.id, comp.created
    comp.id, comp.created = nil, nil
    local text, err = _M.encode(comp)
    comp.id, comp.created = id, created
    if not text then
        return nil, err
    end
    if text:sub(1, 1) ~= "{" or #text < 3 then
        return nil, "body is not a JSON object"
    end
    return text:sub(2)
end

-- The answer text of a stored tail with a fresh id (a string of URL-safe characters)
-- and created (integer epoch seconds).
function _M.splice(tail, id, created)
    return '{"id":"' .. id .. '","created":' .. format("%d", created) .. "," .. tail
end

-- ------------------------------------------------------------------ serving a hit

-- Splits s into pieces of about `size` bytes, never inside a UTF-8 character.
local function pieces(s, max_pieces)
    local out = {}
    local len = #s
    if len == 0 then
        return out
    end
    local size = math.max(16, math.ceil(len / max_pieces))
    local i = 1
    while i <= len do
        local j = i + size - 1
        if j >= len then
            j = len
        else
            -- move the end back while the next byte continues a character
            while j > i do
                local b = byte(s, j + 1)
                if b < 0x80 or b >= 0xC0 then
                    break
                end
                j = j - 1
            end
        end
        out[#out + 1] = sub(s, i, j)
        i = j + 1
    end
    return out
end
_M.pieces = pieces

local MAX_PIECES = 32

-- The text fields of a chat message a stream replay sends, in the order a node sends
-- them: the reasoning (under either name), the content, a refusal.
local TEXT_FIELDS = { "reasoning_content", "reasoning", "content", "refusal" }

local function event(t)
    return "data: " .. _M.encode(t) .. "\n\n"
end

-- SSE text of a stored completion.
function _M.sse(comp, kind, id, created, include_usage)
    local parts = {}
    local function chunk(choice)
        local t = obj({
            id = id,
            object = kind == "chat" and "chat.completion.chunk" or "text_completion",
            created = created,
            model = comp.model,
            system_fingerprint = comp.system_fingerprint,
            choices = arr({ choice }),
        })
        parts[#parts + 1] = event(t)
    end
    for _, c in ipairs(comp.choices) do
        if kind == "chat" then
            local m = c.message
            chunk(obj({ index = c.index, logprobs = null, finish_reason = null,
                        delta = obj({ role = m.role or "assistant", content = "" }) }))
            for _, f in ipairs(TEXT_FIELDS) do
                if type(m[f]) == "string" then
                    for _, p in ipairs(pieces(m[f], MAX_PIECES)) do
                        chunk(obj({ index = c.index, logprobs = null, finish_reason = null,
                                    delta = obj({ [f] = p }) }))
                    end
                end
            end
            if m.tool_calls then
                for i, tc in ipairs(m.tool_calls) do
                    chunk(obj({ index = c.index, logprobs = null, finish_reason = null,
                                delta = obj({ tool_calls = arr({ obj({
                                    index = i - 1, id = tc.id, type = tc.type,
                                    ["function"] = tc["function"] }) }) }) }))
                end
            end
            chunk(obj({ index = c.index, logprobs = null, finish_reason = c.finish_reason,
                        stop_reason = c.stop_reason, delta = obj() }))
        else
            for _, p in ipairs(pieces(c.text or "", MAX_PIECES)) do
                chunk(obj({ index = c.index, text = p, logprobs = null, finish_reason = null }))
            end
            chunk(obj({ index = c.index, text = "", logprobs = null,
                        finish_reason = c.finish_reason, stop_reason = c.stop_reason }))
        end
    end
    if include_usage then
        parts[#parts + 1] = event(obj({
            id = id,
            object = kind == "chat" and "chat.completion.chunk" or "text_completion",
            created = created,
            model = comp.model,
            system_fingerprint = comp.system_fingerprint,
            choices = arr(),
            usage = comp.usage,
        }))
    end
    parts[#parts + 1] = "data: [DONE]\n\n"
    return concat(parts)
end

local function similarity_text(v)
    v = tonumber(v) or 0
    if v >= 1 then
        return "1.0"
    end
    return format("%.4f", v < 0 and 0 or v)
end
_M.similarity_text = similarity_text

-- SSE replays rendered once per worker with marks in place of "id" and "created"
-- (a mark can only stand as a value of those keys: inside a JSON string every quote is
-- escaped), by stored body text, kind and include_usage; emptied at SSE_MEMO_MAX.
_M.SSE_MEMO_MAX = 256
local ID_MARK, CREATED_MARK = "@@IGID@@", -7
local ID_PAT, CREATED_PAT = '"id":"@@IGID@@"', '"created":%-7([,}])'
local sse_memo = require("infergate.core.memo").new(_M.SSE_MEMO_MAX)

local function memo_slot(kind, include_usage)
    return (include_usage and "u:" or "n:") .. kind
end

-- The cached SSE template of a stored body, or nil.
function _M.sse_cached(body_text, kind, include_usage)
    local m = sse_memo:get(body_text)
    return m and m[memo_slot(kind, include_usage)] or nil
end

-- The SSE template of `comp` (stored as body_text), cached for the next hits.
function _M.sse_template(body_text, comp, kind, include_usage)
    local tpl = _M.sse(comp, kind, ID_MARK, CREATED_MARK, include_usage)
    local m = sse_memo:get(body_text) or sse_memo:set(body_text, {})
    m[memo_slot(kind, include_usage)] = tpl
    return tpl
end

-- The SSE text of a template with the request's id and created.
function _M.sse_fill(tpl, id, created)
    local out = tpl:gsub(ID_PAT, '"id":"' .. id .. '"')
    out = out:gsub(CREATED_PAT, '"created":' .. format("%d", created) .. "%1")
    return out
end

-- Answers the request from a stored completion and ends it.
-- c: the request's cache state {kind = "chat"|"text", stream, include_usage}; comp: the
-- decoded stored form, or nil with tail (the entry's "tail") for a non-streaming answer
-- or sse_tpl (sse_template) for a streaming one.
function _M.send(req, c, comp, stored_at, match, similarity, tail, sse_tpl)
    local now = ngx.time()
    local id = (c.kind == "chat" and "chatcmpl-" or "cmpl-") .. (req.id or tostring(now))
    ngx.status = 200
    ngx.header["X-Cache-Status"] = "HIT"
    ngx.header["X-Cache-Match"] = match
    ngx.header["X-Cache-Similarity"] = similarity_text(similarity)
    if type(stored_at) == "number" then
        ngx.header["Age"] = tostring(math.max(0, floor(ngx_now() - stored_at)))
    end
    local body
    if c.stream then
        ngx.header["Content-Type"] = "text/event-stream"
        ngx.header["Cache-Control"] = "no-cache"
        if sse_tpl then
            body = _M.sse_fill(sse_tpl, id, now)
        else
            body = _M.sse(comp, c.kind, id, now, c.include_usage)
        end
    elseif tail then
        ngx.header["Content-Type"] = "application/json"
        body = _M.splice(tail, id, now)
    else
        ngx.header["Content-Type"] = "application/json"
        comp.id = id
        comp.created = now
        body = _M.encode(comp)
    end
    ngx.print(body)
    return ngx.exit(ngx.HTTP_OK)
end

return _M
