-- Token usage of a proxied answer, for the rate limiter's correction (body_filter).
--
-- Only for requests charged to a tokens bucket (req.track_usage, set by
-- infergate.admission.ratelimit) and only while a node's 2xx answer passes through. Keeps the
-- last TAIL bytes of the body (the "usage" object ends a chat/completions JSON answer
-- and, with stream_options.include_usage, is the last event of a stream) and, for
-- streams, counts the chunks that carry content. At the end of the body sets
--
--   req.usage = {prompt_tokens, completion_tokens, total_tokens, estimated = bool}
--
-- from the last "usage" object found, or, for a stream without one, prompt tokens as
-- estimated up front + one completion token per content chunk (estimated = true).
-- Any other stream only has its content chunks counted (req.out_chunks).
-- No I/O: runs in body_filter.
local reqctx = require("infergate.core.reqctx")
local ngxapi = require("infergate.core.ngxapi")
local ngx_var = ngxapi.var

local _M = {}

local tonumber = tonumber
local type = type
local ipairs = ipairs

_M.TAIL = 16384

local find = string.find
local match = string.match
local sub = string.sub
local concat = table.concat

local FIELD_PATTERN = {}
for _, name in ipairs({ "prompt_tokens", "completion_tokens", "total_tokens" }) do
    FIELD_PATTERN[name] = '"' .. name .. '"%s*:%s*(%d+)'
end

local function field(obj, name)
    return tonumber(match(obj, FIELD_PATTERN[name]))
end

-- The last "usage": {...} object of text: {prompt_tokens, completion_tokens,
-- total_tokens} (numbers or nil), or nil. The "usage" keys are found by plain search
-- (a pattern tried at every byte of a 16 KB tail costs more than the rest of the body
-- filter), the last one followed by an object wins.
function _M.parse(text)
    if type(text) ~= "string" then
        return nil
    end
    local at, n = {}, 0
    local from = 1
    while true do
        local s = find(text, '"usage"', from, true)
        if not s then
            break
        end
        n = n + 1
        at[n] = s
        from = s + 7
    end
    local last
    for i = n, 1, -1 do
        last = match(text, '^"usage"%s*:%s*(%b{})', at[i])
        if last then
            break
        end
    end
    if not last then
        return nil
    end
    local u = {
        prompt_tokens = field(last, "prompt_tokens"),
        completion_tokens = field(last, "completion_tokens"),
        total_tokens = field(last, "total_tokens"),
    }
    if not u.total_tokens and (u.prompt_tokens or u.completion_tokens) then
        u.total_tokens = (u.prompt_tokens or 0) + (u.completion_tokens or 0)
    end
    if not u.total_tokens then
        return nil
    end
    return u
end

-- Number of SSE events in chunk carrying non-empty content (plain search for the key,
-- then the pattern at it: no copy of the chunk).
function _M.content_chunks(chunk)
    local n, from = 0, 1
    while true do
        local _, e = find(chunk, '"content"', from, true)
        if not e then
            return n
        end
        if find(chunk, '^%s*:%s*"[^"]', e + 1) then
            n = n + 1
        end
        from = e + 1
    end
end

-- Keeps chunk among the body's last pieces: at least the last TAIL bytes, as a list
-- (req.usage_parts from req.usage_first to req.usage_n, req.usage_bytes in all), so a
-- stream's many small chunks are not each copied into a new 16 KB string.
function _M.keep(req, chunk)
    local p = req.usage_parts
    if not p then
        p = {}
        req.usage_parts, req.usage_first, req.usage_n, req.usage_bytes = p, 1, 0, 0
    end
    local n = req.usage_n + 1
    p[n] = chunk
    local bytes = req.usage_bytes + #chunk
    local first = req.usage_first
    -- the oldest pieces go while the others still hold TAIL bytes
    while first < n and bytes - #p[first] >= _M.TAIL do
        bytes = bytes - #p[first]
        p[first] = nil
        first = first + 1
    end
    req.usage_first, req.usage_n, req.usage_bytes = first, n, bytes
end

-- The last TAIL bytes of the body kept by keep(), or nil when none was.
function _M.tail(req)
    local p = req.usage_parts
    if not p then
        return nil
    end
    local s = concat(p, "", req.usage_first, req.usage_n)
    if #s > _M.TAIL then
        s = sub(s, -_M.TAIL)
    end
    return s
end

-- Completion tokens of the request's answer as known so far: its usage's, else a
-- stream's counted content chunks; nil when neither is known.
function _M.completion_tokens(req)
    local u = req.usage
    return u and u.completion_tokens or req.out_chunks
end

-- The usage of a whole answer `a` ({status, body}) read for a request whose client left
-- (infergate.stream.leg reads on for a llama.cpp node's slot): what the token buckets
-- are settled on, as if the client had got it.
function _M.note_answer(req, a)
    if req.usage or not req.track_usage or not a or not a.status
            or a.status < 200 or a.status >= 300 or type(a.body) ~= "string" then
        return
    end
    local body = a.body
    if #body > _M.TAIL then
        body = sub(body, -_M.TAIL)
    end
    req.usage = _M.parse(body)
end

function _M.body_filter()
    local req = reqctx.get()
    if not req or req.usage then
        return
    end
    if not req.track_usage then
        -- every stream: its content chunks, the completion tokens the scheduler learns
        -- output lengths from (infergate.routing.lengths), no copy of the body
        local chunk = ngx.arg[1]
        if req.stream and type(chunk) == "string" and chunk ~= "" then
            req.out_chunks = (req.out_chunks or 0) + _M.content_chunks(chunk)
        end
        return
    end
    local status = ngx.status
    if not status or status < 200 or status >= 300
            or not (req.relay or ngx_var("upstream_status")) then
        return
    end
    local chunk, eof = ngx.arg[1], ngx.arg[2]
    if type(chunk) == "string" and chunk ~= "" then
        _M.keep(req, chunk)
        if req.stream then
            req.usage_chunks = (req.usage_chunks or 0) + _M.content_chunks(chunk)
        end
    end
    if eof then
        local u = _M.parse(_M.tail(req))
        if not u and req.stream then
            local prompt = req.est_tokens or 0
            local completion = req.usage_chunks or 0
            u = { prompt_tokens = prompt, completion_tokens = completion,
                  total_tokens = prompt + completion, estimated = true }
        end
        req.usage = u
        req.usage_parts = nil
    end
end

return _M
