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
local config = require("infergate.core.config")
local workers = require("infergate.core.workers")

local _M = {}

_M.NAMES = { "auth_rejected", "auth_unavailable", "auth_throttled", "auth_kept",
             "auth_store_missing", "auth_static", "auth_wait_expired", "rate_limited", "limits_local", "shed",
             "deadline_exceeded", "waiting", "held" }

local function dict()
    return ngx.shared[options.DICT_LIMITS]
end

-- The gauges (counts a request takes and gives back): each worker also keeps its own
-- share in the infergate_stats dict, "ag:<pid>:<gauge>", so that what a worker that is
-- gone (killed, crashed) held is given back (give_back, from
-- infergate.routing.stats.reconcile) instead of staying in the gauge for good.
local GAUGES = { waiting = true, held = true }
local own_keys = {}   -- gauge -> this worker's "ag:<pid>:<gauge>"

local function own_key(name)
    local k = own_keys[name]
    if not k then
        k = "ag:" .. workers.pid() .. ":" .. name
        own_keys[name] = k
    end
    return k
end

-- Adds n (default 1) to a counter; its new value (nil when the dict refused).
function _M.incr(name, n)
    n = n or 1
    if GAUGES[name] then
        ngx.shared[config.DICT_STATS]:incr(own_key(name), n, 0)
    end
    return (dict():incr("c:" .. name, n, 0))
end

-- The share `v` of gauge `name` a worker that is gone (`pid`) held comes off the gauge
-- (never below 0).
function _M.give_back(name, v, pid)
    if not (GAUGES[name] and v and v ~= 0) then
        return
    end
    local left = dict():incr("c:" .. name, -v, 0)
    if left and left < 0 then
        dict():set("c:" .. name, 0)
    end
    ngx.log(ngx.WARN, "infergate: ", v, " ", name, " request(s) of worker ", pid,
            ", which is gone, taken off the admission gauge")
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
