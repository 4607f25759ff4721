-- The stream_options rewrite of a cached stream: a stream whose answer will be stored
-- (MISS, or BYPASS that still stores) and that did not ask for
-- stream_options.include_usage is sent to the node with
-- "stream_options": {"include_usage": true}, so the stored entry carries usage and can
-- answer any later request; infergate.cache.capture strips the usage-only chunk from
-- what the client receives. The body is rewritten as text, every other byte as the
-- client sent it: without "stream_options" the member is put right after the opening
-- brace; with one (e.g. {"include_usage": false, "continuous_usage_stats": true}) only
-- its value is replaced, when it occurs once in the body and is a scalar or a flat
-- object, else the body is left alone. The cache key was worked out from the decoded
-- body before (and never holds stream_options).
local cjson = require("cjson.safe")
local replay = require("infergate.cache.replay")
local reqctx = require("infergate.core.reqctx")

local _M = {}

local type = type
local pairs = pairs
local next = next
local setmetatable = setmetatable
local byte = string.byte
local sub = string.sub
local find = string.find
local log = ngx.log
local DEBUG = ngx.DEBUG

local USAGE_MEMBER = '"stream_options":{"include_usage":true},'

-- Position in the body text just before the value of its "stream_options" member, or
-- nil, err. The member's one occurrence: a '"stream_options"' whose opening quote is not
-- escaped (an even number of backslashes before it), followed by ':', is a key; the top
-- level's, when the body has only one.
local function stream_options_at(text)
    local e, pos, n = nil, 1, 0
    while true do
        local s1, e1 = find(text, '"stream_options"%s*:%s*', pos)
        if not s1 then
            break
        end
        local b = s1 - 1
        while b > 0 and byte(text, b) == 92 do -- a backslash
            b = b - 1
        end
        if (s1 - 1 - b) % 2 == 0 then
            n = n + 1
            e = e1
        end
        pos = e1 + 1
    end
    if n ~= 1 then
        return nil, "stream_options not found once"
    end
    return e
end

-- Whether a decoded stream_options table was a JSON object in the body: cjson decodes
-- [] and {} alike (and [x] to a table with [1]), and a node refuses an array there.
local function options_object(so)
    if so[1] ~= nil then
        return false
    end
    if next(so) ~= nil then
        return true
    end
    local req = reqctx.get()
    local text = req and req.raw_body
    local e = text and stream_options_at(text)
    return e ~= nil and byte(text, e + 1) == 123 -- "{"
end

-- The body text with include_usage asked, or nil, err. `so`: the decoded
-- stream_options of the body (nil when it has none).
function _M.with_usage(text, so)
    if type(text) ~= "string" then
        return nil, "no body text"
    end
    local open = find(text, "{", 1, true)
    if not open then
        return nil, "body is not an object"
    end
    if so == nil then
        return sub(text, 1, open) .. USAGE_MEMBER .. sub(text, open + 1)
    end
    local e, err = stream_options_at(text)
    if not e then
        return nil, err
    end
    local vs, ve
    if byte(text, e + 1) == 123 then -- "{"
        vs, ve = find(text, "^%b{}", e + 1)
        if not vs or type(cjson.decode(sub(text, vs, ve))) ~= "table" then
            return nil, "stream_options is not an object without braces in its strings"
        end
    else
        vs, ve = find(text, "^[%w%.%+%-]+", e + 1)
        if not vs then
            return nil, "stream_options is not a scalar or object"
        end
    end
    local value = '{"include_usage":true}'
    if type(so) == "table" then
        local copy = setmetatable({}, replay.OBJECT_MT)
        for k, v in pairs(so) do
            copy[k] = v
        end
        copy.include_usage = true
        local enc = replay.encode(copy)
        if not enc then
            return nil, "stream_options cannot be encoded"
        end
        value = enc
    end
    return sub(text, 1, vs - 1) .. value .. sub(text, ve + 1)
end
_M.options_object = options_object

-- Asks the node for usage in the request body (ngx.req.set_body_data); c.usage_added
-- once asked.
function _M.ask_usage(req, c)
    local body, err = _M.with_usage(req.raw_body, req.body.stream_options)
    if not body then
        log(DEBUG, "infergate: cache: stream usage not asked of the node: ", err)
        return
    end
    ngx.req.set_body_data(body)
    c.usage_added = true
end

return _M
