-- A node restarted under this edge's requests: the control plane saw its metrics'
-- counters begin again between two polls and names, as the snapshot's
-- "restarted_after", the time of its last reading of the process before (epoch s). A
-- request sent to the node before then went to that process; if no byte came back, none
-- will (in a break test, a llama-server stopped with SIGTERM kept the connections it had
-- accepted open without answering them, while the new process answered health checks
-- on the same port): a relayed leg still waiting for its head gives up and is retried on another
-- node (infergate.stream.leg), instead of waiting out its deadline.
-- No I/O: safe in every phase.
local snapshot = require("infergate.routing.snapshot")

local _M = {}

-- Margin (s) for the clocks of the control plane and the edge (one host under `up`, NTP
-- across hosts): only an attempt started this long before the process was last seen
-- counts as sent to it. One sent after that last reading (up to a poll interval before
-- the stop) cannot be told from one sent to the new process, and waits as before.
_M.SKEW_S = 0.25

-- Whether attempt `att` (its `started`, epoch s) on `node` went to a process of the node
-- that the current snapshot says was replaced since.
function _M.sent_before(node, att)
    local cur = snapshot.current().by_name[node.name]
    local after = cur and cur.restarted_after
    return after ~= nil and att.started < after - _M.SKEW_S
end

return _M
