-- Room on a node: fewer of this edge's requests in flight (or, while it has none, of
-- others' requests its metrics show) than the node runs at once.
-- The delay cost (infergate.routing.balancer.least_delay) never queues a request behind
-- others on one node while another candidate has room: at loads where least_conn queues
-- nothing, nothing queues here either, and a node that is faster but full does not make
-- every later request wait for it (the median would pay for it). No I/O.
--
-- What a node runs at once: the most it was seen running while requests waited there
-- (a fresh snapshot with queue_depth > 0; a request that just arrived waits for the
-- next step, so one sight can be short of the limit, never over it), kept for
-- SEEN_TTL_S after it was last raised (shared dict infergate_stats "rb:<node>"), else
-- its learned concurrency with its guard rails (infergate.routing.speed.batch), which
-- answers of very different lengths make noisy.
local config = require("infergate.core.config")
local stats = require("infergate.routing.stats")
local speed = require("infergate.routing.speed")
local others = require("infergate.routing.others")

local _M = {}

_M.SEEN_TTL_S = 600

local shared = ngx.shared

-- Requests `node` runs at once (see the header).
function _M.batch(node)
    local d = shared[config.DICT_STATS]
    local key = "rb:" .. node.name
    local seen = d:get(key)
    local r = node.running
    if r and r >= 1 and (node.queue_depth or 0) > 0 and (not seen or r > seen) then
        seen = r
        d:set(key, r, _M.SEEN_TTL_S)
    end
    return seen or speed.batch(node)
end

-- Whether `node` has room: this edge's requests in flight there, or the requests of
-- others its metrics show while this edge has none (infergate.routing.others), are
-- fewer than it runs at once.
function _M.has(node, now)
    local n = stats.inflight(node.name)
    if n == 0 then
        n = others.count(node, now or ngx.now(), 0)
    end
    return n < _M.batch(node)
end

-- The candidates of pool[1..m] to pass over ({[i] = true}): those without room, when at
-- least one other has room; nil when all or none have room.
function _M.full(pool, m)
    local full, any = nil, false
    for i = 1, m do
        if _M.has(pool[i]) then
            any = true
        else
            full = full or {}
            full[i] = true
        end
    end
    return any and full or nil
end

return _M
