-- Counters of admission control on this edge (all workers, since nginx started), in
-- the infergate_limits shared dict under "c:<name>". Published with the edge stats
-- (infergate:v1:edges, field "admission") and on /infergate/status.
--
--   auth_rejected      401: missing, unknown or revoked API key
--   auth_unavailable   503: key not cached and Redis unreachable
--   auth_throttled     429: key not cached, its client address past its budget of failed
--                      lookups (infergate.admission.auththrottle), Redis not asked
--   auth_kept          valid keys honoured from this edge's memory while Redis answers
--                      without its key store (infergate.admission.auth)
--   auth_store_missing gauge: 1 while this edge sees Redis without its key store
--   auth_static        keys checked against the key store's records held in memory
--                      while Redis is unreachable (infergate.admission.knownkeys)
--   auth_wait_expired  requests that waited the whole LOOKUP_WAIT_S for another
--                      request's lookup of the same key and then looked it up themselves
--                      (infergate.admission.auth; stays 0 while lookups end in time)
--   rate_limited       429: a per-key or global token bucket was empty
--   limits_local       rate-limit decisions taken on this edge's local buckets (Redis down)
--   shed               429: every eligible node stayed saturated for the whole wait
--   deadline_exceeded  504: the request's deadline passed before a node answered
--   waiting            gauge: requests waiting for capacity right now
--   held               gauge: requests held for a node of their model to come back
--                      right now (infergate.admission.thaw)
--
-- No I/O: safe in every phase.
local options = require("infergate.admission.options")

local _M = {}

_M.NAMES = { "auth_rejected", "auth_unavailable", "auth_throttled", "auth_kept",
             "auth_store_missing", "auth_static", "auth_wait_expired", "rate_limited", "limits_local", "shed",
             "deadline_exceeded", "waiting", "held" }

local function dict()
    return ngx.shared[options.DICT_LIMITS]
end

-- Adds n (default 1) to a counter; its new value (nil when the dict refused).
function _M.incr(name, n)
    return (dict():incr("c:" .. name, n or 1, 0))
end

-- Sets the gauge name to 1 for ttl seconds (then it reads 0 again).
function _M.flag(name, ttl)
    dict():set("c:" .. name, 1, ttl)
end

function _M.get(name)
    return dict():get("c:" .. name) or 0
end

-- {name = count} for every counter.
function _M.all()
    local d = dict()
    local out = {}
    for _, name in ipairs(_M.NAMES) do
        out[name] = d:get("c:" .. name) or 0
    end
    return out
end

return _M
