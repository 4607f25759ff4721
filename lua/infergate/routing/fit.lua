-- Whether a node can still finish a request before its deadline: the predicted completion
-- of one more request on the node, at the tail of its answer times, against the time
-- the request has left. No I/O: safe in every phase.
--
--   extra(node, now, req)       what the request's own time adds at the node's high
--                               quantile over its mean: s x (tail / mean - 1), s the
--                               node's service time (infergate.routing.speed), tail and
--                               mean of its answer times (infergate.routing.learned.tail_s,
--                               capped by the request's max_tokens: then it may be
--                               negative); 0 while the node has no history
--   completion(node, now, req)  one more request's time on the node at the tail of its
--                               answer times (infergate.routing.learned.tail_s of its
--                               latency EWMA: its own queue included, as the answers
--                               that taught it waited there too), of which a stream whose
--                               answers outrun its deadline counts nothing
--                               (infergate.admission.deadline.own_s), and the latency
--                               EWMA (s) it came from; nil while the node has no latency
--                               history
--   fits(node, now, req, left)  completion within `left` s, or unknown (nil completion)
local stats = require("infergate.routing.stats")
local speed = require("infergate.routing.speed")
local learned = require("infergate.routing.learned")
local deadline = require("infergate.admission.deadline")

local _M = {}

function _M.extra(node, now, req)
    local lat = stats.latency_ewma_ms(node.name)
    local s = speed.aged_service_s(node.name, now)
    if not lat or lat <= 0 or not s then
        return 0
    end
    local m = lat / 1000
    return s * (learned.tail_s(node.name, m, req, now) / m - 1)
end

function _M.completion(node, now, req)
    local lat = stats.latency_ewma_ms(node.name)
    if not lat or lat <= 0 then
        return nil
    end
    local m = lat / 1000
    return deadline.own_s(req, learned.tail_s(node.name, m, req, now)), m
end

function _M.fits(node, now, req, left)
    local c = _M.completion(node, now, req)
    return not c or c <= left
end

return _M
