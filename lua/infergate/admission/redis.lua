-- Redis calls of the admission steps (API-key lookups, shared token buckets), from the
-- access phase and from timers: infergate.redis.pool (pooled connections, the shared
-- back-off after a failure) plus the outage log of API keys and rate limits.
--
--   local ar = require("infergate.admission.redis")
--   local res, err = ar.run(fn, a, b, d)   -- fn(c, a, b, d), e.g. c:command("HGET", a, b)
--   -- res: the reply; false, err: a Redis error reply; nil, err: Redis unreachable
--   -- (a transport error, or skipped during the pool's back-off)
--
-- The outage is logged once when it starts and once when it ends (a flag in the
-- infergate_limits dict, shared by the workers).
local pool = require("infergate.redis.pool")
local options = require("infergate.admission.options")

local _M = {}

local log = ngx.log
local WARN = ngx.WARN
local NOTICE = ngx.NOTICE
local tostring = tostring

local function dict()
    return ngx.shared[options.DICT_LIMITS]
end

local function mark_down(err)
    if dict():add("redis_outage_logged", true) then
        log(WARN, "infergate: Redis unreachable for API keys and rate limits (cached keys and ",
            "per-edge limits apply until it returns): ", tostring(err))
    end
end

local function mark_up()
    local d = dict()
    if d:get("redis_outage_logged") then
        d:delete("redis_outage_logged")
        log(NOTICE, "infergate: Redis reachable again for API keys and rate limits")
    end
end

-- Runs fn(client, a, b, d) on a pooled connection to the edge's Redis
-- (infergate.redis.pool.run_with). Returns fn's results: value, false, err (Redis error
-- reply) or nil, err (unreachable).
function _M.run(fn, a, b, d)
    local res, err = pool.run_with(fn, a, b, d)
    if res == nil and err ~= nil then
        mark_down(err)
    elseif res ~= nil then
        mark_up()
    end
    return res, err
end

return _M
