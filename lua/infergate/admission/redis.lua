-- Redis access of the admission steps (API-key lookups, shared token buckets) from the
-- access phase and from timers, with a short memory of failures shared by the workers:
-- after a transport error (refused, timeout) Redis is skipped for limits.redis_retry_s,
-- so an outage costs one failed attempt per interval instead of a timeout per request.
--
--   local ar = require("infergate.admission.redis")
--   local res, err = ar.run(function(c) return c:command("HGET", k, f) end)
--   -- err "redis_down" (skipped), or the client's error
--
-- Redis error replies ("ERR ...", "NOSCRIPT ...") are not outages: the connection goes
-- back to the pool and the error is returned. The outage is logged once when it starts
-- and once when it ends (flags in the infergate_limits dict).
local redis = require("infergate.redis.client")
local config = require("infergate.core.config")
local options = require("infergate.admission.options")

local _M = {}

local log = ngx.log
local WARN = ngx.WARN
local NOTICE = ngx.NOTICE
local tostring = tostring

local conf, conf_err

local function dict()
    return ngx.shared[options.DICT_LIMITS]
end

local function redis_conf()
    if not conf and not conf_err then
        conf, conf_err = redis.parse_url(config.get().redis_url)
    end
    return conf, conf_err
end

-- False while a recent transport error says Redis is down.
function _M.usable()
    return not dict():get("redis_down")
end

local function mark_down(err)
    local d = dict()
    d:set("redis_down", true, options.get().limits.redis_retry_s)
    if d:add("redis_outage_logged", true) then
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

-- Runs fn(client) on a pooled connection. Returns fn's results, or nil, err.
function _M.run(fn)
    if not _M.usable() then
        return nil, "redis_down"
    end
    local c, err = redis_conf()
    if not c then
        return nil, "bad redis url: " .. tostring(err)
    end
    local client
    client, err = redis.connect(c, config.get().redis_timeout_ms)
    if not client then
        mark_down(err)
        return nil, err
    end
    local ok, res, ferr = pcall(fn, client)
    if not ok then
        client:close()
        return nil, "redis call failed: " .. tostring(res)
    end
    if not client.sock then
        -- transport error inside fn: the client closed the connection
        mark_down(ferr)
        return nil, ferr
    end
    client:keepalive()
    mark_up()
    return res, ferr
end

return _M
