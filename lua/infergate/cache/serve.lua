-- Serving a cache hit (infergate.cache.replay): the X-Cache-Entry header, the
-- namespace's hit counts, and the online verification queue (see
-- infergate.cache.lookup).
local ngx_now = require("infergate.core.ngxapi").now
local keynames = require("infergate.redis.keynames")
local replay = require("infergate.cache.replay")
local flush = require("infergate.core.flush")
local shared = require("infergate.cache.shared")

local _M = {}

local type = type
local tonumber = tonumber

local opts = nil

-- The [cache] options (infergate.cache.lookup.init).
function _M.configure(o)
    opts = o
end

-- Queues a semantic hit for the control plane's verification (flush queue; see the
-- header). The request body as received, else re-encoded.
local function queue_verify(req, c, key, ns)
    local body = req.raw_body
    if not body and type(req.body) == "table" then
        body = replay.encode(req.body)
    end
    if type(body) ~= "string" or #body > shared.VERIFY_MAX_BODY_BYTES then
        return false
    end
    local item = replay.encode({ key = key, namespace = ns, path = c.path,
                                 model = c.model or "", tenant = c.tenant or "default",
                                 body = body, ts = ngx_now() })
    if not item then
        return false
    end
    local q = keynames.cache_verify_queue
    return flush.push("cache_verify", {
        { "RPUSH", q, item },
        -- bounded while no control plane takes items: the newest are kept
        { "LTRIM", q, -opts.verify_queue_max, -1 },
        { "EXPIRE", q, shared.VERIFY_QUEUE_TTL_S },
    })
end
_M.queue_verify = queue_verify

local random = math.random

-- Answers the request from `entry` (match "exact" | "semantic"; key: the entry's exact
-- key hex, c.key when absent).
function _M.serve(req, c, entry, match, similarity, key)
    c.status = "HIT"
    c.match = match
    c.similarity = similarity
    key = key or c.key
    c.entry_key = key
    ngx.header[shared.ENTRY_HEADER] = key
    local ns = entry.doc.namespace
    if type(ns) ~= "string" or ns == "" then
        ns = c.namespace
    end
    if type(ns) == "string" and ns ~= "" then
        local h = keynames.cache_ns_stats(ns)
        flush.count(h, match == "semantic" and "hits_semantic" or "hits_exact", 1,
            shared.NS_STATS_TTL_S)
        local f = opts.verify_fraction or 0
        if match == "semantic" and f > 0 and (f >= 1 or random() < f)
            and queue_verify(req, c, key, ns) then
            flush.count(h, "verify_queued", 1, shared.NS_STATS_TTL_S)
        end
    end
    return replay.send(req, c, entry.comp, tonumber(entry.doc.created), match, similarity,
        entry.tail, entry.sse)
end

return _M
