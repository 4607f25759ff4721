-- Cache entries as read from Redis: decoding a stored entry into the form a hit is
-- served from (parse_entry), and the exact read of an entry by its key.
local cjson = require("cjson.safe")
local ngx_now = require("infergate.core.ngxapi").now
local keynames = require("infergate.redis.keynames")
local replay = require("infergate.cache.replay")
local hotcache = require("infergate.cache.hotcache")

local _M = {}

local type = type
local null = cjson.null

-- The usable entry in a raw GET reply (a string or ngx.null) for the request's cache
-- state `c`, or nil (absent or unusable): {doc, tail} for a non-streaming request when
-- the entry has "tail" (infergate.cache.replay.splice), {doc, sse} for a stream whose
-- replay this worker already rendered, else {doc, comp (the decoded stored form),
-- sse (streams)}. An entry stored without usage (a stream whose node ignored the
-- include_usage the edge asked for, cache.stream_usage off, or an older entry) cannot
-- answer a request whose answer must carry usage (a non-streaming one, or a stream with
-- stream_options.include_usage), which then goes to a node and stores a complete entry
-- in its place.
local function decode_entry(raw)
    if raw == null or type(raw) ~= "string" then
        return nil
    end
    local doc = cjson.decode(raw)
    if type(doc) ~= "table" or type(doc.body) ~= "string" then
        return nil
    end
    return doc
end

function _M.parse_doc(doc, c)
    -- a non-streaming answer from the stored bytes (replay.splice), nothing decoded
    if not c.stream and type(doc.tail) == "string" and type(doc.usage) == "boolean" then
        if not doc.usage then
            return nil
        end
        return { doc = doc, tail = doc.tail }
    end
    -- a stream: the replay rendered for an earlier hit of the same stored body
    if c.stream then
        local tpl = replay.sse_cached(doc.body, c.kind, c.include_usage)
        if tpl then
            return { doc = doc, sse = tpl }
        end
    end
    local comp = replay.decode_stored(doc.body, c.kind)
    if not comp then
        return nil
    end
    if type(comp.usage) ~= "table" and (not c.stream or c.include_usage) then
        return nil
    end
    if c.stream then
        return { doc = doc, comp = comp,
                 sse = replay.sse_template(doc.body, comp, c.kind, c.include_usage) }
    end
    return { doc = doc, comp = comp }
end

function _M.parse_entry(raw, c)
    local doc = decode_entry(raw)
    return doc and _M.parse_doc(doc, c)
end

-- The usable entry of `key` from a raw GET reply, kept as a worker-local copy
-- (infergate.cache.hotcache).
function _M.entry_of(raw, key, c)
    local doc = decode_entry(raw)
    if not doc then
        return nil
    end
    hotcache.put(key, doc, #raw, ngx_now())
    return _M.parse_doc(doc, c)
end

-- The entry of `key` read with client rc: see parse_entry, or nil, err (transport
-- error) or false, err (Redis error reply).
function _M.get_entry(rc, key, c)
    local raw, err = rc:command("GET", keynames.cache_entry(key))
    if not raw then
        return raw, err
    end
    return _M.entry_of(raw, key, c)
end

return _M
