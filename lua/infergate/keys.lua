-- Every Redis key name the edge uses. Mirrors controlplane/keys.py (tests compare both).
local _M = {}

local BASE = "infergate:v1"
_M.BASE = BASE

_M.routing = BASE .. ":routing"
_M.routing_version = BASE .. ":routing:version"
_M.leader = BASE .. ":leader"
_M.nodes = BASE .. ":nodes"
_M.node_states = BASE .. ":node_states"
_M.edges = BASE .. ":edges"
_M.events = BASE .. ":events"

function _M.node_metrics(name)
    return BASE .. ":node:" .. name .. ":metrics"
end

function _M.node_history(name)
    return BASE .. ":node:" .. name .. ":history"
end

return _M
