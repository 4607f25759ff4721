-- Options of admission control (API keys, rate limits, shedding, deadlines): the
-- admission view of the edge options that infergate.core.config validated against the
-- rendered spec (controlplane/config/ holds every default and range: the [auth],
-- [limits], [admission] and [deadlines] sections).
--
--   options.get() ->
--   {auth      = {mode = "off"|"required", cache_ttl_s, negative_ttl_s, stale_ttl_s,
--                 fail_burst, fail_rate_per_s},
--    limits    = {enabled, global_rpm, global_tpm, chars_per_token, redis_retry_s},
--    shed      = {enabled, max_wait_ms, poll_ms, retry_after_s},
--    deadlines = {request_ms, stream_idle_ms,
--                 routes = {["/v1/embeddings"] = {request_ms, stream_idle_ms}}}}
--
-- Units: _s seconds, _ms milliseconds; global_rpm/global_tpm 0 = no global limit;
-- request_ms 0 = no deadline; a route's fields left out of the file are the global ones.
local _M = {}

-- Shared dict names; they must match the lua_shared_dict lines of infergate-http.conf.
_M.DICT_AUTH = "infergate_auth"          -- valid keys
_M.DICT_AUTH_NEG = "infergate_auth_neg"  -- unknown and revoked keys
_M.DICT_AUTH_FAIL = "infergate_auth_fail"  -- failed lookups per client address
_M.DICT_LIMITS = "infergate_limits"

-- The tenant of every request when auth is off.
_M.DEFAULT_TENANT = "default"

-- The admission options of the running edge (infergate.core.config.init must have run).
function _M.get()
    return require("infergate.core.config").get().admission
end

return _M
