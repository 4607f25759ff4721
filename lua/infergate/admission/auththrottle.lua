-- Per client address budget of API-key lookups that found no valid key (unknown or
-- revoked): a token bucket of auth.fail_burst lookups refilled at auth.fail_rate_per_s,
-- in the infergate_auth_fail shared dict under "b:<address>" ("<tokens> <epoch_s>",
-- forgotten once full again). An address past its budget has its keys refused before
-- they cost a Redis call (infergate.admission.auth answers 429 auth_throttled). Keys
-- the edge has cached never reach this module, so valid keys in use are not slowed.
--
-- The workers share the buckets without a lock: two workers may both spend the last
-- token (a few lookups more than the budget at worst, never fewer).
-- Without the shared dict (a hand-written config) or with fail_burst = 0 nothing is limited.
local options = require("infergate.admission.options")

local _M = {}

local tonumber = tonumber
local fmt = string.format

local function dict()
    return ngx.shared[options.DICT_AUTH_FAIL]
end

local function level(d, addr, now, o)
    local v = d:get("b:" .. addr)
    if type(v) ~= "string" then
        return o.fail_burst
    end
    local tokens, ts = v:match("^(%S+) (%S+)$")
    tokens, ts = tonumber(tokens), tonumber(ts)
    if not tokens or not ts then
        return o.fail_burst
    end
    local l = tokens + (now - ts) * o.fail_rate_per_s
    return l < o.fail_burst and l or o.fail_burst
end

-- 0 when a key of addr may be looked up in Redis now, else the seconds until one may.
function _M.wait(addr, now, o)
    local d = dict()
    if not d or o.fail_burst <= 0 or not addr then
        return 0
    end
    local l = level(d, addr, now, o)
    if l >= 1 then
        return 0
    end
    return (1 - l) / o.fail_rate_per_s
end

-- Counts one lookup of addr that found no valid key.
function _M.spend(addr, now, o)
    local d = dict()
    if not d or o.fail_burst <= 0 or not addr then
        return
    end
    local l = level(d, addr, now, o) - 1
    if l < 0 then
        l = 0
    end
    d:set("b:" .. addr, fmt("%.3f %.3f", l, now), (o.fail_burst - l) / o.fail_rate_per_s + 1)
end

return _M
