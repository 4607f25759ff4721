-- Fair share of a saturated pool (admission.fair_share): requests that must wait for a
-- slot (infergate.admission.slots) wait in one queue per flow, a flow being a tenant
-- and a priority class, and the free slots go, in this order, to
--   1. the higher class: critical, then standard, then sheddable;
--   2. within a class, the tenant with the smallest virtual token counter
--      (infergate.admission.vtc: tokens served / weight); on a tie (a tenant that
--      starts waiting starts at the same counter) the flow with fewer requests
--      waiting, then by name;
--   3. within a flow, first come first served (infergate.admission.queue).
-- No dispatcher: every waiting request computes its rank on each poll — the waiting
-- flows ordered before its own, plus the requests ahead of it in its flow — and takes a
-- slot when its rank is below the free slots. Cheaply: a request with as many requests
-- ahead in its own flow as there are free slots stops there; the waiting flows are read
-- at most every WAITING_CACHE_S per worker (and after this worker's joins and leaves),
-- the registry and the counters' "busy" mark refreshed at most every REFRESH_S. So no request is held back while a slot
-- is free for it (work-conserving), and with k free slots the first k in that order
-- go. A flow that starts waiting starts its tenant's counter at the smallest counter of
-- the flows already waiting in the pool (vtc.start), so an idle tenant banks no credit
-- and keeps no debt.
--
-- The waiting flows of a pool are found through a registry in the shared dict
-- infergate_stats: slots "fe:<pool>:<i>" (i = 1..MAX_FLOWS) hold a flow's name while
-- it waited in the last FLOW_TTL_S; a flow past MAX_FLOWS in one pool is not listed
-- (its requests still wait, ranked after the listed flows).
--
-- While another flow waits in the pool, a flow's queue holds at most
-- admission.tenant_queue_max requests; past it a request gets the fast 429
-- (infergate.admission.shed). A flow waiting alone is bounded by the deadline rule, as
-- without the fair share, and by ALONE_FACTOR x tenant_queue_max (512 by default: every
-- waiting request polls, so one tenant's flood must not cost the edge unbounded CPU):
-- the cap is there to keep one tenant's backlog from crowding the others, and with
-- nobody else waiting it would only refuse requests the pool can still serve in time.
-- The order of service above, not the cap, is what keeps a tenant that arrives later
-- from waiting behind that backlog.
local config = require("infergate.core.config")
local queue = require("infergate.admission.queue")
local vtc = require("infergate.admission.vtc")

local _M = {}

local sub = string.sub
local tonumber = tonumber

-- Priority classes by name, higher first.
_M.CLASSES = { critical = 3, standard = 2, sheddable = 1 }
_M.MAX_FLOWS = 256
-- A flow waiting alone may hold this many times admission.tenant_queue_max (see below).
_M.ALONE_FACTOR = 8
local FLOW_TTL_S = 60
_M.WAITING_CACHE_S = 0.005
local REFRESH_S = 0.5

local cached = {}       -- pool -> {at, list}: this worker's last read of the waiting flows
local refreshed = {}    -- "<pool>\1<flow>" -> when this worker last refreshed its entry
local nrefreshed = 0
local REFRESHED_MAX = 10000

local function mark_refreshed(key, now)
    if not refreshed[key] then
        nrefreshed = nrefreshed + 1
        if nrefreshed > REFRESHED_MAX then   -- flows long gone: start over
            refreshed, nrefreshed = {}, 1
        end
    end
    refreshed[key] = now
end

local function dict()
    return ngx.shared[config.DICT_STATS]
end

-- The flow of `tenant` in class `class` (1..3): "<class digit><tenant>".
function _M.flow(tenant, class)
    return class .. tenant
end

local function parse(flow)
    return tonumber(sub(flow, 1, 1)) or 2, sub(flow, 2)
end

-- The queue name of `flow` in `pool` (infergate.admission.queue keys).
local function qname(pool, flow)
    return "f" .. pool .. "\1" .. flow
end
_M.qname = qname

-- Whether flow a = {class, vc, n (requests waiting), name} is served before flow b (the order of the header).
function _M.before(a, b)
    if a.class ~= b.class then
        return a.class > b.class
    end
    if a.vc ~= b.vc then
        return a.vc < b.vc
    end
    if a.n ~= b.n then
        return (a.n or 0) < (b.n or 0)
    end
    return a.name < b.name
end

-- The rank of a request at `pos` (0 = head) in flow `mine` among the waiting flows
-- `others` (each {class, vc, n, name}; mine may be among them): the requests served
-- before it. Every request of a higher class goes first (when several slots free at
-- once, a sheddable request takes none while critical ones wait); of a flow of its own
-- class ordered before it, its head (the slots of one round go one per tenant, in the
-- order of the counters).
function _M.rank(mine, pos, others)
    local r = pos
    for i = 1, #others do
        local o = others[i]
        if o.name ~= mine.name and _M.before(o, mine) then
            r = r + ((o.class > mine.class) and (o.n or 1) or 1)
        end
    end
    return r
end

-- Keeps `flow` listed in the registry of `pool` (every poll while it waits).
function _M.register(pool, flow)
    local d = dict()
    local rk = "fr:" .. pool .. "\1" .. flow
    local pre = "fe:" .. pool .. ":"
    local i = d:get(rk)
    if i and d:get(pre .. i) == flow then
        d:set(pre .. i, flow, FLOW_TTL_S)
        d:set(rk, i, FLOW_TTL_S)
        return true
    end
    local n = d:get("fn:" .. pool) or 0
    for j = 1, n do
        if d:add(pre .. j, flow, FLOW_TTL_S) then   -- a slot no flow holds any more
            d:set(rk, j, FLOW_TTL_S)
            return true
        end
    end
    if n < _M.MAX_FLOWS then
        local j = d:incr("fn:" .. pool, 1, 0)
        if j <= _M.MAX_FLOWS then
            d:set(pre .. j, flow, FLOW_TTL_S)
            d:set(rk, j, FLOW_TTL_S)
            return true
        end
    end
    return false
end

-- The flows with waiting requests in `pool`: a list of {class, vc, n, name, tenant}.
-- fresh: read now, not this worker's read of the last WAITING_CACHE_S.
function _M.waiting(pool, fresh)
    local now = ngx.now()
    local c = cached[pool]
    if not fresh and c and now - c.at < _M.WAITING_CACHE_S then
        return c.list
    end
    local d = dict()
    local n = d:get("fn:" .. pool) or 0
    local out, seen = {}, {}
    local pre = "fe:" .. pool .. ":"
    for i = 1, n do
        local f = d:get(pre .. i)
        if f and not seen[f] then
            seen[f] = true
            local len = queue.length(qname(pool, f))
            if len > 0 then
                local class, tenant = parse(f)
                out[#out + 1] = { class = class, vc = vtc.get(tenant), n = len, name = f,
                                  tenant = tenant }
            end
        end
    end
    cached[pool] = { at = now, list = out }
    return out
end

-- Whether any request waits in `pool` (in a flow other than `except`, when given).
function _M.any_waiting(pool, except)
    local d = dict()
    local n = d:get("fn:" .. pool) or 0
    local pre = "fe:" .. pool .. ":"
    for i = 1, n do
        local f = d:get(pre .. i)
        if f and f ~= except and queue.length(qname(pool, f)) > 0 then
            return true
        end
    end
    return false
end

-- The request joins `flow` of `pool`: nil, "full" past `max` waiting while another flow
-- waits in the pool (past ALONE_FACTOR x `max` alone), else its ticket.
-- A flow that had nobody waiting starts its tenant's counter at the smallest counter of
-- the other flows waiting in the pool (unchanged when none waits).
function _M.join(pool, flow, max, poll_s)
    local q = qname(pool, flow)
    local len = queue.length(q)
    if len >= max and (len >= max * _M.ALONE_FACTOR or _M.any_waiting(pool, flow)) then
        return nil, "full"
    end
    if len == 0 then
        local _, tenant = parse(flow)
        local lowest, active = nil, false
        for _, o in ipairs(_M.waiting(pool, true)) do
            if o.tenant == tenant then
                active = true          -- waiting in another class: it goes on from there
            elseif not lowest or o.vc < lowest then
                lowest = o.vc
            end
        end
        if not active then
            vtc.start(tenant, lowest)
        end
    end
    _M.register(pool, flow)
    mark_refreshed(pool .. "\1" .. flow, ngx.now())
    vtc.busy()
    cached[pool] = nil
    return queue.join(q, poll_s)
end

-- The rank of `ticket` in `flow` of `pool` now (see rank()), or only the requests ahead
-- of it in its flow when they are `free` or more (it cannot be served now either way);
-- also keeps it waiting.
function _M.position(pool, flow, ticket, now, poll_s, free)
    local q = qname(pool, flow)
    local pos = queue.ahead(q, ticket, now)
    queue.alive(q, ticket, poll_s)
    local rk = pool .. "\1" .. flow
    if now - (refreshed[rk] or 0) >= REFRESH_S then
        mark_refreshed(rk, now)
        _M.register(pool, flow)
        vtc.busy()
    end
    if free and pos >= free then
        return pos
    end
    local list = _M.waiting(pool)
    local class, tenant = parse(flow)
    local mine = { class = class, vc = vtc.get(tenant), n = 1, name = flow }
    for i = 1, #list do
        if list[i].name == flow then
            mine.n = list[i].n
            break
        end
    end
    return _M.rank(mine, pos, list)
end

-- The ticket leaves its flow (admitted, shed or shutting down).
function _M.leave(pool, flow, ticket, now)
    queue.leave(qname(pool, flow), ticket, now)
    cached[pool] = nil
end

return _M
