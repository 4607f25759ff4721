-- One charge or correction of a request's buckets (infergate.admission.ratelimit): by
-- the script in Redis (infergate.admission.bucketscript), or on this edge's local
-- buckets (infergate.admission.localbuckets) when Redis cannot be reached or is backed
-- off (infergate.admission.redis, infergate.redis.pool).
local astats = require("infergate.admission.stats")
local bucketscript = require("infergate.admission.bucketscript")
local localbuckets = require("infergate.admission.localbuckets")

local _M = {}

local log = ngx.log
local ERR = ngx.ERR

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
        log(ERR, "infergate: rate-limit script failed: ", err)
    end
    astats.incr("limits_local")
    return localbuckets.apply(mode == "lease" and "take" or mode, list, costs), "local"
end

return _M
