-- Names, limits and small helpers shared by the response cache's access-phase modules
-- (infergate.cache.lookup and the modules it is made of).
local pool = require("infergate.redis.pool")

local _M = {}

local byte = string.byte
local sub = string.sub

_M.DICT = "infergate_cache"
_M.LOOKUP_LOCATION = "/_infergate/cache/lookup"
_M.PATHS = { ["/v1/chat/completions"] = "chat", ["/v1/completions"] = "text" }
-- Shortest time between two "lookup skipped" lines of a worker, seconds.
_M.LOG_EVERY_S = 10
--- Longest last-user text sent to the embedder (bytes, cut on a character boundary).
_M.MAX_TEXT_BYTES = 16384
-- Header naming the entry a hit was served from (its exact key hex).
_M.ENTRY_HEADER = "X-Cache-Entry"
-- TTL (s) of the per-namespace figures, renewed by every count (= the global counters').
_M.NS_STATS_TTL_S = 30 * 86400
-- TTL (s) of the verification queue, renewed by every push
-- (controlplane.cache.verify.QUEUE_TTL_S).
_M.VERIFY_QUEUE_TTL_S = 86400
-- Request bodies larger than this (bytes) are not queued for verification.
_M.VERIFY_MAX_BODY_BYTES = 65536
-- Value of a coalescing lock once its leader ended without storing an answer
-- (infergate.cache.capture): waiters and identical requests go to a node at once.
_M.NOSTORE = "nostore"

-- s cut to at most n bytes, on a UTF-8 character boundary.
function _M.cut_utf8(s, n)
    if #s <= n then
        return s
    end
    local i = n
    while i > 0 do
        local b = byte(s, i + 1)
        if b < 0x80 or b >= 0xC0 then
            break
        end
        i = i - 1
    end
    return sub(s, 1, i)
end

-- fn(client, a, b) on a pooled connection (infergate.redis.pool: skipped while Redis is
-- backed off after a failure). Returns fn's result, or nil, err when Redis failed or
-- answered an error. Arguments instead of a closure: a function created per request
-- keeps LuaJIT from compiling the path.
function _M.with_redis(fn, a, b)
    local res, err = pool.run_with(fn, a, b)
    if res == false or err then
        return nil, err or "redis error"
    end
    return res
end

return _M
