-- balancer_by_lua entry: the node choice itself lives in infergate.routing.balancer
-- (pure, no I/O: cosockets are not allowed in this phase).
local routing_balancer = require("infergate.routing.balancer")

local _M = {}

function _M.run()
    return routing_balancer.run()
end

return _M
