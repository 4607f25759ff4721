-- Virtual token counters of the fair share (infergate.admission.fairqueue), in the
-- spirit of the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
-- Language Models", OSDI 2024): per tenant, the tokens it was served (prompt + output)
-- divided by its weight; among waiting tenants the one with the smallest counter is
-- served first, and a tenant that starts waiting starts at the smallest counter of the
-- tenants already waiting (start; VTC's lift, here also downwards), so time spent idle
-- banks no credit and service from before it went idle is no debt.
--
-- Shared by every edge through Redis (hash keynames.fairshare_counters, tenant ->
-- float), cheaply: a charge adds to this worker's pending deltas and to the shared
-- dict infergate_stats ("vp:<tenant>", seen by every worker at once); the worker's
-- flush timer (infergate.core.flush.on_tick) sends them in its batched pipeline (one
-- EVAL of SCRIPT: each counter becomes (its start value, or itself) + charges, so two
-- edges starting one tenant at once start it once) and, while requests
-- wait on this edge (busy()), reads the whole hash back in the same script call into
-- "vg:<tenant>". No round trip on the request path. A tenant's counter here is vg + vp:
-- what Redis said at the last flush plus what this edge's workers changed since. Redis
-- unreachable: the changes stay pending and the counters are this edge's own until it
-- answers again.
local config = require("infergate.core.config")
local flush = require("infergate.core.flush")
local keynames = require("infergate.redis.keynames")

local _M = {}

local pairs = pairs
local tonumber = tonumber
local tostring = tostring
local format = string.format

_M.TTL_S = 86400            -- the hash in Redis, renewed by every write
local LOCAL_TTL_S = 3600     -- "vg:" entries of tenants not seen since
local BUSY_KEY = "vbusy"     -- set while requests wait on this edge
local BUSY_TTL_S = 2

-- This worker's changes since its last flush, per tenant: d = tokens / weight charged
-- after f, f = the value it was started at (nil: none), l = what it added to
-- "vp:<tenant>".
local pending, npending = {}, 0

local function entry(tenant)
    local p = pending[tenant]
    if not p then
        p = { d = 0, l = 0 }
        pending[tenant] = p
        npending = npending + 1
    end
    return p
end

local function dict()
    return ngx.shared[config.DICT_STATS]
end

-- The counter of `tenant` (tokens / weight; 0 for a tenant never served).
function _M.get(tenant)
    local d = dict()
    return (d:get("vg:" .. tenant) or 0) + (d:get("vp:" .. tenant) or 0)
end

-- Adds `tokens` / `weight` (weight > 0; nil = 1) to the counter of `tenant`.
function _M.charge(tenant, tokens, weight)
    local x = tokens / (weight or 1)
    if x == 0 or x ~= x then
        return
    end
    dict():incr("vp:" .. tenant, x, 0)
    local p = entry(tenant)
    p.d = p.d + x
    p.l = p.l + x
end

-- Sets the counter of `tenant` to `at` (a tenant that starts waiting starts at the
-- smallest counter of the tenants already waiting: no credit banked while idle, no debt
-- kept from before). In Redis it is a set, not an addition: two edges starting the same
-- tenant at once start it once. Returns the change here.
function _M.start(tenant, at)
    local v = _M.get(tenant)
    if not at or at == v then
        return 0
    end
    dict():incr("vp:" .. tenant, at - v, 0)
    local p = entry(tenant)
    p.f = at           -- what was charged before is replaced by it
    p.d = 0
    p.l = p.l + (at - v)
    return at - v
end

-- Requests wait on this edge: the flush reads the counters of the other edges back.
function _M.busy()
    dict():set(BUSY_KEY, true, BUSY_TTL_S)
end

-- KEYS[1]: the counters' hash. ARGV: ttl_ms, read (1|0), then per tenant: name, floor
-- ("" for none), delta. Each counter becomes (floor, or the counter without one) +
-- delta. Returns the whole hash (HGETALL) when read, else 0.
_M.SCRIPT = [[
local key = KEYS[1]
for i = 3, #ARGV, 3 do
  local v = tonumber(ARGV[i + 1]) or tonumber(redis.call("HGET", key, ARGV[i])) or 0
  redis.call("HSET", key, ARGV[i], string.format("%.17g", v + tonumber(ARGV[i + 2])))
end
if #ARGV > 2 then
  redis.call("PEXPIRE", key, ARGV[1])
end
if ARGV[2] == "1" then
  return redis.call("HGETALL", key)
end
return 0
]]

-- The pipeline of one flush (one EVAL of SCRIPT) when there are changes or `read`,
-- and the changes it carries (tenant -> {d, f, l}); nil when there is nothing to do.
function _M.commands(read)
    if npending == 0 and not read then
        return nil
    end
    local args = { "EVAL", _M.SCRIPT, "1", keynames.fairshare_counters,
                   tostring(_M.TTL_S * 1000), read and "1" or "0" }
    local sent = pending
    for tenant, p in pairs(sent) do
        args[#args + 1] = tenant
        args[#args + 1] = p.f and format("%.17g", p.f) or ""
        args[#args + 1] = format("%.17g", p.d)
    end
    pending, npending = {}, 0
    return { args }, sent
end

-- Puts changes that did not reach Redis back in front of the newer ones.
local function restore(sent)
    for tenant, p in pairs(sent) do
        local q = pending[tenant]
        if not q then
            pending[tenant] = p
            npending = npending + 1
        elseif not q.f then        -- a newer start (q.f) replaces the older changes
            q.f = p.f
            q.d = p.d + q.d
            q.l = p.l + q.l
        else
            q.l = p.l + q.l
        end
    end
end

-- The reply of one flush: the changes leave "vp:" (they are in Redis now); the hash
-- read back (a flat {tenant, value, ...} array) becomes "vg:", or without a read "vg:"
-- takes the changes as Redis did. A failed flush keeps them for the next one.
function _M.settle(sent, read, replies, err)
    local d = dict()
    local reply = replies and replies[1]
    if not replies or (type(reply) == "table" and reply[1] == false) then
        if err ~= "queue full" then
            restore(sent)
            return
        end
        reply = nil   -- dropped: the changes stay this edge's own
    end
    for tenant, p in pairs(sent) do
        d:incr("vp:" .. tenant, -p.l, 0)
    end
    if read and type(reply) == "table" then
        for i = 1, #reply - 1, 2 do
            local v = tonumber(reply[i + 1])
            if v then
                d:set("vg:" .. reply[i], v, LOCAL_TTL_S)
            end
        end
        return
    end
    for tenant, p in pairs(sent) do
        d:set("vg:" .. tenant, (p.f or d:get("vg:" .. tenant) or 0) + p.d, LOCAL_TTL_S)
    end
end

-- Flush hook (every tick of the worker's flush timer): queues the pending deltas, and
-- the read of the shared counters while requests wait on this edge.
function _M.tick()
    local read = dict():get(BUSY_KEY) and true or false
    local cmds, sent = _M.commands(read)
    if not cmds then
        return
    end
    flush.push("fairshare", cmds, function(replies, err)
        _M.settle(sent, read, replies, err)
    end)
end

flush.on_tick(_M.tick)

return _M
