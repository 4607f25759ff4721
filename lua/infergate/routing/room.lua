-- Room on a node: fewer of this edge's requests in flight than the node runs at once
-- (its learned concurrency with its guard rails, infergate.routing.speed.batch). The
-- delay cost (infergate.routing.balancer.least_delay) never queues a request behind
-- others on one node while another candidate has room: at loads where least_conn queues
-- nothing, nothing queues here either, and a node that is faster but full does not make
-- every later request wait for it (the median would pay for it). No I/O.
local stats = require("infergate.routing.stats")
local speed = require("infergate.routing.speed")

local _M = {}

-- Whether `node` has room.
function _M.has(node)
    return stats.inflight(node.name) < speed.batch(node)
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
