-- One charge or correction of a request's buckets (infergate.admission.ratelimit): by
-- the script in Redis (infergate.admission.bucketscript), or on this edge's local
-- buckets (infergate.admission.localbuckets) when Redis cannot be reached or is backed
-- off (infergate.admission.redis, infergate.redis.pool).
local astats = require("infergate.admission.stats")
local options = require("infergate.admission.options")
local bucketscript = require("infergate.admission.bucketscript")
local localbuckets = require("infergate.admission.localbuckets")

local _M = {}

local log = ngx.log
local ERR = ngx.ERR

-- A script that fails on every request (Redis out of memory with noeviction, a command
-- renamed away) is logged at most once per LOG_EVERY_S over the workers, with the number
-- of failures since the line before: not a line per request.
_M.LOG_EVERY_S = 10

local function log_failure(err)
    local d = ngx.shared[options.DICT_LIMITS]
    local n = d:incr("rl_script_failed", 1, 0) or 1
    if d:add("rl_script_failed_logged", true, _M.LOG_EVERY_S) then
        d:set("rl_script_failed", 0)
        log(ERR, "infergate: rate-limit script failed: ", err, " (", n, " failure(s) since ",
            "the last such line, at most one a ", _M.LOG_EVERY_S, " s; each decided on ",
            "this edge's local buckets)")
    end
end

-- Charges `list` (mode "take"; "lease" with wants: also takes up to wants[i] tokens
-- ahead, result.granted[i]) or corrects it (mode "adjust", costs per bucket).
-- extra, on_extra (optional): one more Redis command sent in the same pipeline, and
-- on_extra(reply) called with its reply (not called when Redis was not reached).
-- Returns result {allowed, tokens = {}, wait = {}[, granted = {}]}, source
-- "redis"|"local" (local buckets grant no lease).
function _M.apply(mode, list, costs, extra, on_extra, wants)
    local res, err = bucketscript.redis_apply(mode, list, costs, extra, on_extra, wants)
    if res then
        if mode ~= "adjust" and res.tokens then
            localbuckets.mirror(list, res.tokens)
        end
        return res, "redis"
    end
    if res == false then
        -- a Redis error reply (not an outage): say so, decide locally this time
        log_failure(err)
    end
    astats.incr("limits_local")
    return localbuckets.apply(mode == "lease" and "take" or mode, list, costs), "local"
end

return _M
