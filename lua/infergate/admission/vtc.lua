-- Virtual token counters of the fair share (infergate.admission.fairqueue), in the
-- spirit of the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
-- Language Models", OSDI 2024): per tenant, the tokens it was served (prompt + output)
-- divided by its weight; among waiting tenants the one with the smallest counter is
-- served first, and a tenant that starts waiting is lifted to the smallest counter of
-- the tenants already waiting (lift), so time spent idle banks no credit.
--
-- Shared by every edge through Redis (hash keynames.fairshare_counters, tenant ->
-- float), cheaply: a charge adds to this worker's pending deltas and to the shared
-- dict infergate_stats ("vp:<tenant>", seen by every worker at once); the worker's
-- flush timer (infergate.core.flush.on_tick) sends the deltas in its batched pipeline
-- (HINCRBYFLOAT per tenant, PEXPIRE) and, while requests wait on this edge (busy()),
-- reads the whole hash back in the same pipeline into "vg:<tenant>". No round trip on
-- the request path. A tenant's counter here is vg + vp: what Redis said at the last
-- flush plus what this edge's workers charged since. Two edges lifting one tenant at the
-- same moment lift it twice (it then waits one lift longer); Redis unreachable: the
-- deltas stay pending and the counters are this edge's own until it answers again.
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

local pending, npending = {}, 0

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
    if not pending[tenant] then
        npending = npending + 1
    end
    pending[tenant] = (pending[tenant] or 0) + x
end

-- Raises the counter of `tenant` to `floor` when it is below (a tenant that starts
-- waiting). Returns the amount it was raised by.
function _M.lift(tenant, floor)
    local v = _M.get(tenant)
    if floor and floor > v then
        _M.charge(tenant, floor - v, 1)
        return floor - v
    end
    return 0
end

-- Requests wait on this edge: the flush reads the counters of the other edges back.
function _M.busy()
    dict():set(BUSY_KEY, true, BUSY_TTL_S)
end

-- The pipeline of one flush: HINCRBYFLOAT per pending tenant, PEXPIRE, and HGETALL
-- when `read`. Returns cmds, sent (tenant -> delta) or nil when there is nothing to do.
function _M.commands(read)
    if npending == 0 and not read then
        return nil
    end
    local key = keynames.fairshare_counters
    local cmds, sent = {}, pending
    for tenant, x in pairs(sent) do
        cmds[#cmds + 1] = { "HINCRBYFLOAT", key, tenant, format("%.17g", x) }
    end
    pending, npending = {}, 0
    if #cmds > 0 then
        cmds[#cmds + 1] = { "PEXPIRE", key, tostring(_M.TTL_S * 1000) }
    end
    if read then
        cmds[#cmds + 1] = { "HGETALL", key }
    end
    return cmds, sent
end

-- The replies of one flush: the sent deltas leave "vp:" (they are in Redis now), the
-- hash read back (a flat {tenant, value, ...} array) becomes "vg:". A failed flush puts
-- the deltas back into pending.
function _M.settle(sent, read, replies, err)
    local d = dict()
    if not replies then
        if err ~= "queue full" then
            for tenant, x in pairs(sent) do
                if not pending[tenant] then
                    npending = npending + 1
                end
                pending[tenant] = (pending[tenant] or 0) + x
            end
            return
        end
        for tenant, x in pairs(sent) do   -- dropped: the charge stays local only
            d:incr("vg:" .. tenant, x, 0, LOCAL_TTL_S)
            d:incr("vp:" .. tenant, -x, 0)
        end
        return
    end
    for tenant, x in pairs(sent) do
        d:incr("vp:" .. tenant, -x, 0)
    end
    local all = read and replies[#replies]
    if type(all) == "table" and all[1] ~= false then
        for i = 1, #all - 1, 2 do
            local v = tonumber(all[i + 1])
            if v then
                d:set("vg:" .. all[i], v, LOCAL_TTL_S)
            end
        end
    elseif not read then
        for tenant, x in pairs(sent) do   -- the edge's own view until the next read
            d:incr("vg:" .. tenant, x, 0, LOCAL_TTL_S)
        end
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
