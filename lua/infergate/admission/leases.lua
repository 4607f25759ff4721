-- Leases of the rate limits (limits.lease_fraction > 0; see
-- infergate.admission.ratelimit): tokens a worker takes ahead from a bucket in Redis
-- and spends without a round trip, given back once LEASE_TTL_S old.
local ngx_now = require("infergate.core.ngxapi").now
local bucketcharge = require("infergate.admission.bucketcharge")
local settlement = require("infergate.admission.settlement")

local _M = {}

local ipairs = ipairs
local pairs = pairs
local floor = math.floor
local ceil = math.ceil
local min = math.min

-- Leases (worker-local, see infergate.admission.ratelimit): bucket key -> {left =
-- tokens leased and not spent, at = ngx.now() of the last grant, spent = tokens this
-- worker charged to the bucket since then, tokens = the bucket's tokens in Redis after
-- that grant, refilling = ngx.now() when a request went for the next lease, bucket}.
_M.LEASE_TTL_S = 1
-- A lease is sized to last this long at the worker's recent rate on the bucket.
_M.LEASE_TARGET_S = 0.25
_M.LEASE_MAX = 1000
local leases = {}

-- Gives the unspent tokens of an expired lease back to its bucket (flush queue).
local function refund(b, left)
    if left > 0 then
        settlement.queue_correction({ b }, { -left }, "redis")
    end
end

local function refill_under_way(l, now)
    return l.refilling ~= nil and now - l.refilling < _M.LEASE_TTL_S
end

local function live_lease(b, now)
    local l = leases[b.key]
    if l and now - l.at < _M.LEASE_TTL_S then
        return l
    end
    return nil
end

-- What a bucket's lease shows as remaining: the bucket's tokens in Redis at the last
-- grant, refilled since, plus this worker's leased tokens.
local function lease_remaining(l, b, now)
    return min(b.capacity, l.tokens + (now - l.at) * b.rate) + l.left
end

-- Tokens to lease ahead per bucket of `list` (the buckets a request takes to Redis):
-- none for a bucket this worker has not charged within LEASE_TTL_S or whose next lease
-- another request is already bringing; else what this worker charged it per second
-- since the last grant x LEASE_TARGET_S, less what it still holds (at least the cost
-- when any, at most lease_fraction x capacity and LEASE_MAX). That request then brings
-- the next lease (refilling).
local function lease_wants(list, now, fraction)
    local wants = {}
    for i, b in ipairs(list) do
        local l = live_lease(b, now)
        local w = 0
        if l and not refill_under_way(l, now) then
            local dt = now - l.at
            if dt < 0.001 then
                dt = 0.001
            end
            w = ceil((l.spent + b.cost) / dt * _M.LEASE_TARGET_S) - l.left
            if w > 0 and w < b.cost then
                w = b.cost
            end
            local most = floor(b.capacity * fraction)
            if most > _M.LEASE_MAX then
                most = _M.LEASE_MAX
            end
            if w > most then
                w = most
            end
            if w > 0 then
                l.refilling = now
            else
                w = 0
            end
        end
        wants[i] = w
    end
    return wants
end

-- After the script call of mode "lease" for `list` (at `now`): keeps what Redis granted
-- (when it was Redis and the request was allowed; res.tokens then count this worker's
-- leased tokens as remaining too), and ends this request's refill either way.
local function lease_store(list, res, source, now, wants)
    local ok = source == "redis" and res.allowed
    for i, b in ipairs(list) do
        local l = leases[b.key]
        if l and now - l.at >= _M.LEASE_TTL_S then
            refund(b, l.left)
            leases[b.key] = nil
            l = nil
        end
        if ok then
            if not l then
                l = { left = 0, at = now, spent = 0, tokens = res.tokens[i], bucket = b, size = 0 }
                leases[b.key] = l
            end
            l.spent = l.spent + b.cost
            if wants[i] > 0 then
                l.left = l.left + (res.granted[i] or 0)
                l.at, l.spent, l.size, l.tokens = now, 0, wants[i], res.tokens[i]
            end
            res.tokens[i] = res.tokens[i] + l.left
        end
        if l and wants[i] > 0 then
            l.refilling = nil
        end
    end
end

-- Charges a request with leases on: each bucket whose lease covers the cost (and is not
-- down to half its size with no refill under way) pays from it; the others go to Redis
-- together in one script call that also brings their next leases. The leased share is
-- set aside before the call (other requests of the worker run while it waits) and given
-- back when Redis refuses. Returns result {allowed, tokens, wait} over `list`, source.
-- companion: ratelimit.companion (a Redis command to send along), or nil.
function _M.leased_charge(req, list, now, fraction, companion)
    local remote, held = nil, {}   -- indices to Redis; index -> lease paying
    for i, b in ipairs(list) do
        local l = live_lease(b, now)
        if l and l.left >= b.cost
                and (l.left - b.cost >= l.size / 2 or refill_under_way(l, now)) then
            held[i] = l
            l.left = l.left - b.cost   -- set aside
        else
            remote = remote or {}
            remote[#remote + 1] = i
        end
    end
    local out = { allowed = true, tokens = {}, wait = {} }
    local source = "redis"  -- a lease was charged in Redis when it was granted
    if remote then
        local sub = {}
        for j, i in ipairs(remote) do
            sub[j] = list[i]
        end
        local extra, on_extra
        if companion then
            extra, on_extra = companion(req)
        end
        local wants = lease_wants(sub, now, fraction)
        local r
        r, source = bucketcharge.apply("lease", sub, nil, extra, on_extra, wants)
        ngx.update_time()
        lease_store(sub, r, source, ngx_now(), wants)
        out.allowed = r.allowed
        for j, i in ipairs(remote) do
            out.tokens[i], out.wait[i] = r.tokens[j], r.wait[j]
        end
    end
    for i, b in ipairs(list) do
        local l = held[i]
        if l then
            if out.allowed then
                l.spent = l.spent + b.cost
            else
                l.left = l.left + b.cost   -- refused: the set-aside tokens go back
            end
            out.tokens[i] = lease_remaining(l, b, now)
            out.wait[i] = 0
        end
    end
    return out, source
end

-- Flush timer: expired leases go back to their buckets and are forgotten.
function _M.sweep_leases(now)
    now = now or ngx_now()
    for key, l in pairs(leases) do
        if now - l.at >= _M.LEASE_TTL_S then
            leases[key] = nil
            refund(l.bucket, l.left)
        end
    end
end

return _M
