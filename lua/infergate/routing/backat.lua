-- When the control plane last saw each node come back (the routing snapshot's
-- "back_at", epoch s: a good poll that turned it healthy again, or metrics whose
-- counters began again), as of this worker's current snapshot. Kept here, set by
-- infergate.routing.snapshot as it builds a snapshot and read by
-- infergate.routing.breaker, which the snapshot module reaches through routing.stats.
-- Per worker, no I/O: safe in every phase.
local _M = {}

local seen = {}

-- nodes: the built snapshot's nodes ({name = , back_at = epoch s or nil}, ...).
function _M.update(nodes)
    local t = {}
    for _, n in ipairs(nodes) do
        if n.back_at then
            t[n.name] = n.back_at
        end
    end
    seen = t
end

-- Epoch s the node was last seen back, or nil (never, or not listed).
function _M.get(name)
    return seen[name]
end

return _M
