-- Worker-local copies of entries read from Redis lately (cache.local_ttl_ms, 0 = none):
-- exact key hex -> {doc = the decoded entry (never changed once decoded), exp = epoch s,
-- never past the entry's expiry}. Repeats of a hot entry are answered without a Redis
-- round trip and without decoding it again; a purged or flagged entry may answer from a
-- worker's copy until that copy expires.
-- Bounded by HOT_MAX_ENTRIES and HOT_MAX_BYTES (of the stored texts): full, it starts
-- over empty.
local _M = {}

local tonumber = tonumber

local opts = nil

-- The [cache] options (infergate.cache.lookup.init).
function _M.configure(o)
    opts = o
end

_M.HOT_MAX_ENTRIES = 1000
_M.HOT_MAX_BYTES = 16 * 1024 * 1024
local hot, hot_count, hot_bytes = {}, 0, 0

function _M.get(key, now)
    local h = hot[key]
    if not h then
        return nil
    end
    if h.exp > now then
        return h.doc
    end
    hot[key] = nil
    hot_count = hot_count - 1
    hot_bytes = hot_bytes - h.size
    return nil
end

function _M.put(key, doc, size, now)
    local ttl = (opts.local_ttl_ms or 0) / 1000
    if ttl <= 0 or size > _M.HOT_MAX_BYTES then
        return
    end
    local old = hot[key]
    if old then
        hot_count = hot_count - 1
        hot_bytes = hot_bytes - old.size
    end
    if hot_count >= _M.HOT_MAX_ENTRIES or hot_bytes + size > _M.HOT_MAX_BYTES then
        hot, hot_count, hot_bytes = {}, 0, 0
    end
    -- never past the entry's own expiry in Redis (stored at "created", for "ttl" s)
    local exp = now + ttl
    local created, life = tonumber(doc.created), tonumber(doc.ttl)
    if created and life and created + life < exp then
        exp = created + life
    end
    hot[key] = { doc = doc, exp = exp, size = size }
    hot_count = hot_count + 1
    hot_bytes = hot_bytes + size
end

return _M
