-- Per client address budget of API-key lookups that found no valid key (unknown or
-- revoked): a token bucket of auth.fail_burst lookups refilled at auth.fail_rate_per_s,
-- in the infergate_auth_fail shared dict under "b:<address>" ("<tokens> <epoch_s>",
-- forgotten once full again). An address past its budget has its keys refused before
-- they cost a Redis call (infergate.admission.auth answers 429 auth_throttled). Keys
-- the edge has cached never reach this module, so valid keys in use are not slowed.
--
-- A lookup is taken from the budget before the Redis call (so many requests in flight
-- at once cannot all pass on the same token) and given back when the key was valid or
-- Redis did not answer. The workers share the buckets without a lock: two workers may
-- both take the last token (a lookup more than the budget at worst, never fewer).
-- Without the shared dict (a hand-written config) or with fail_burst = 0 nothing is limited.
--
-- Besides each address's, one budget for all addresses together ("b:*", ALL_FACTOR times
-- the size and the rate of an address's: 2,500 lookups, 250 a second by default): a
-- flood of made-up keys spread over hundreds of addresses, each within its own budget,
-- sent the key store 2,400 lookups a second: the edge's Redis calls timed out, and it
-- skipped the cache and fell back to per-edge rate limits for every client.
-- take_all / refund_all; keys the key store holds pass whatever either budget says
-- (infergate.admission.auth).
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

local function store(d, addr, l, now, o)
    d:set("b:" .. addr, fmt("%.3f %.3f", l, now), (o.fail_burst - l) / o.fail_rate_per_s + 1)
end

-- Takes one lookup from addr's budget before a key of addr is looked up in Redis:
-- 0 when taken, else the seconds until one is there (nothing taken).
function _M.take(addr, now, o)
    local d = dict()
    if not d or o.fail_burst <= 0 or not addr then
        return 0
    end
    local l = level(d, addr, now, o)
    if l < 1 then
        return (1 - l) / o.fail_rate_per_s
    end
    store(d, addr, l - 1, now, o)
    return 0
end

-- Gives back the lookup taken for a key that turned out valid (or could not be checked).
function _M.refund(addr, now, o)
    local d = dict()
    if not d or o.fail_burst <= 0 or not addr then
        return
    end
    local l = level(d, addr, now, o) + 1
    store(d, addr, l < o.fail_burst and l or o.fail_burst, now, o)
end

_M.ALL_FACTOR = 50
local ALL = "*"
local all_opts = setmetatable({}, { __mode = "k" })

-- The budget of all addresses for options `o` (ALL_FACTOR x its size and rate).
local function all_of(o)
    local a = all_opts[o]
    if not a then
        a = { fail_burst = o.fail_burst * _M.ALL_FACTOR,
              fail_rate_per_s = o.fail_rate_per_s * _M.ALL_FACTOR }
        all_opts[o] = a
    end
    return a
end

-- As take, from the budget of all addresses together.
function _M.take_all(now, o)
    return _M.take(ALL, now, all_of(o))
end

-- As refund, to the budget of all addresses together.
function _M.refund_all(now, o)
    _M.refund(ALL, now, all_of(o))
end

return _M
