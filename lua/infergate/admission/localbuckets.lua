-- The rate limits' token buckets in this edge's infergate_limits shared dict, used while
-- Redis cannot be reached (infergate.admission.ratelimit): the same algorithm as the
-- script in Redis (infergate.admission.bucketscript). "b:<key>" = "tokens ts".
local options = require("infergate.admission.options")
local ngx_now = require("infergate.core.ngxapi").now

local _M = {}

local ipairs = ipairs
local tonumber = tonumber
local min = math.min
local max = math.max
local format = string.format

-- Most a bucket can owe, in minutes of its rate (infergate.admission.bucketscript writes it as 60).
local DEBT_MINUTES = 60

local function dict()
    return ngx.shared[options.DICT_LIMITS]
end

local function lock()
    local d = dict()
    for _ = 1, 50 do
        if d:add("lock:buckets", true, 0.1) then
            return true
        end
        ngx.sleep(0.001)
    end
    return false
end

-- Charges (mode "take": all or none) or corrects (mode "adjust") `list` (costs override
-- the buckets' costs). Returns {allowed, tokens = {}, wait = {}}.
function _M.apply(mode, list, costs)
    local d = dict()
    local locked = lock()
    ngx.update_time()
    local now = ngx_now()
    local st, ok = {}, true
    for i, b in ipairs(list) do
        local cost = costs and costs[i] or b.cost
        local raw = d:get("b:" .. b.key)
        local tokens, ts
        if raw then
            tokens, ts = raw:match("^(%S+) (%S+)$")
            tokens, ts = tonumber(tokens), tonumber(ts)
        end
        if not tokens or not ts then
            tokens, ts = b.capacity, now
        end
        if now > ts then
            tokens = min(b.capacity, tokens + (now - ts) * b.rate)
        end
        st[i] = { tokens, cost }
        if mode == "take" and tokens < cost then
            ok = false
        end
    end
    local out = { allowed = ok, tokens = {}, wait = {} }
    for i, b in ipairs(list) do
        local tokens, cost = st[i][1], st[i][2]
        out.wait[i] = tokens < cost and (cost - tokens) / b.rate or 0
        if ok then
            tokens = max(-b.capacity * DEBT_MINUTES, min(b.capacity, tokens - cost))
            d:set("b:" .. b.key, format("%.6f %.6f", tokens, now),
                  (b.capacity - tokens) / b.rate + 1)
        end
        out.tokens[i] = tokens
    end
    if locked then
        d:delete("lock:buckets")
    end
    return out
end

-- After a charge in Redis: each bucket of `list` at the level Redis reported (tokens[i]),
-- so that buckets taken over by this edge while Redis cannot be reached go on from there
-- instead of starting full (a key that had used up its minute would get its burst again).
function _M.mirror(list, tokens)
    local d = dict()
    local now = ngx_now()
    for i, b in ipairs(list) do
        local t = tonumber(tokens[i])
        if t and t < b.capacity then
            d:set("b:" .. b.key, format("%.6f %.6f", t, now), (b.capacity - t) / b.rate + 1)
        end
    end
end

return _M
