-- Others' requests on a node: what the node's own metrics show it running and queueing
-- when none of it can be this edge's. Other edges in front of the same nodes, and clients
-- that reach a node past the gateway, take slots this edge's own in-flight count does
-- not see; a node full of them looked free here, got the next request, and that request
-- waited in the node's queue behind answers of unknown length while another node idled.
--
-- others(node, now) = running + queue_depth of the node's last metrics poll (the routing
-- snapshot's "running", "queue_depth" and "polled_at", epoch s), counted only when
--   * the poll is at most FRESH_S old,
--   * this edge has no request in flight on the node (its own would be in the figures,
--     and cannot be told apart from others'), and
--   * no attempt of this edge on the node ended later than SKEW_S before the poll
--     ("ae:<node>", infergate.routing.stats: an answer that ended after the poll is in
--     its figures too; SKEW_S covers the clocks of the control plane and the edge)
-- else 0: the rules then stand as before, on this edge's own count. The figures are up
-- to a poll interval old: a node that freed up since is seen free at the next poll (a
-- second by default), and only while another node has room does it matter.
--
-- Used by infergate.admission.slots (a known slot others hold is not free),
-- infergate.routing.room (no room) and infergate.routing.speed.expected_s (work ahead).
-- No I/O: safe in the balancer phase.
local config = require("infergate.core.config")
local stats = require("infergate.routing.stats")
local prefixer = require("infergate.core.memo").prefixer

local _M = {}

_M.FRESH_S = 5
_M.SKEW_S = 1

local ae_key = prefixer("ae:")

-- Requests of others on `node` (see the header), 0 when not known. own: this edge's
-- requests in flight there, when the caller has read them (else read here).
function _M.count(node, now, own)
    local at = node.polled_at
    local running = node.running
    if not at or not running or now - at > _M.FRESH_S then
        return 0
    end
    local n = running + (node.queue_depth or 0)
    if n < 1 or (own or stats.inflight(node.name)) > 0 then
        return 0
    end
    local ended = ngx.shared[config.DICT_STATS]:get(ae_key(node.name))
    if ended and ended > at - _M.SKEW_S then
        return 0
    end
    return math.floor(n)
end

return _M
