-- The verdict on a request's previous try when nginx asks the balancer for the next one
-- (infergate.routing.balancer.run), and whether another try may follow it.
--
--   500            held (infergate.routing.stats.hold): counted against the node only if a
--                  later node answers the request (settled in infergate.log); no try after
--                  the next one (a 500 goes to a second node, no further)
--   429            busy (not a breaker failure)
--   504 at the deadline, a read it cut short (infergate.admission.deadline.expired_try):
--                  neutral, the deadline's fault
--   a free try     neutral: nginx retries a request once, without a try the balancer
--                  granted (set_more_tries), when a kept-alive connection failed
--                  (ngx_http_upstream_next: peer.cached and FT_ERROR); the node closed an
--                  idle connection as it was reused (llama.cpp's server does after a
--                  stream). req.free_try is set, and the balancer may send that try to the
--                  same node on a new connection (once), as nginx's own balancer does.
--   anything else  failure of the node (connect error, reset, timeout before the first
--                  byte, 502/503/504)
local stats = require("infergate.routing.stats")
local outlier = require("infergate.routing.outlier")
local deadline = require("infergate.admission.deadline")

local _M = {}

-- Settles the previous try `prev` of `req` given the status nginx recorded for it
-- (balancer.get_last_failure). Returns whether a further try may be granted.
function _M.settle(req, prev, status, now)
    req.free_try = not req.granted
    if not prev.closed and not prev.held then
        if status == 500 then
            stats.hold(prev, 500)
        elseif status == 429 then
            stats.close_attempt(prev, "busy", now)
        elseif (status == 504 and deadline.expired_try(req)) or req.free_try then
            stats.close_attempt(prev, "neutral", now)
        else
            stats.close_attempt(prev, "fail", now)
        end
    end
    outlier.finished(prev, now)
    return status ~= 500
end

-- The node of the request's n-th try (or a name no node has).
function _M.node_of(req, n)
    local a = req.attempts[n]
    return a and a.node or ""
end

return _M
