-- A request held for a node to come back (infergate.access, step "eligible"): when no
-- node of its model is eligible but one may be back soon (a frozen pool: nginx's proxy
-- would wait on it; a 503 a second would send every client into the outage). The
-- requests held at this edge now (all workers): the admission gauge "held".
local ngxapi = require("infergate.core.ngxapi")
local abort = require("infergate.core.abort")
local snapshot = require("infergate.routing.snapshot")
local balancer = require("infergate.routing.balancer")
local models = require("infergate.routing.models")
local deadline = require("infergate.admission.deadline")
local astats = require("infergate.admission.stats")

local _M = {}

local ngx_now = ngxapi.now
local ipairs = ipairs

-- The slots (known slots, else max_concurrency) of the active nodes of `model` that may
-- be back soon: healthy in the snapshot (out for their circuit breaker, or their one
-- probe in flight), or unhealthy with their last poll connected (frozen: no answer; or
-- answering again, not yet counted back); not refused, not drained. 0: none.
local function returning_slots(t, model)
    local n = 0
    for _, node in ipairs(t.nodes) do
        if (node.healthy or node.connects) and node.addr and node.state == "active"
                and models.serves(node, model) then
            n = n + (node.slots or node.max_concurrency or 1)
        end
    end
    return n
end

-- Poll period (s) of a request held while its model's nodes are out, and how long (s)
-- none of them may be back before the held request gets its 503 (one poll's result can
-- flap: a poll skipped while the previous one still waits says nothing).
_M.THAW_POLL_S = 0.2
_M.THAW_GONE_S = 2

-- No node of the request's model is eligible and one of them may be back soon: as
-- nginx's proxy waits on a frozen node, a request that takes a slot (routes "inference"
-- and "api") is held for one while its deadline leaves room to be served after (a
-- quarter of it left, 1-5 s), at most as many at once as those nodes have slots (the
-- rest get the 503 at once: held longer, they would only meet a full pool); true when
-- a node is eligible again. No deadline: not held.
function _M.held(req, t)
    if req.route ~= "inference" and req.route ~= "api" then
        return false
    end
    local now = ngx_now()
    local left = deadline.remaining(req, now)
    local cap = left and returning_slots(t, req.model) or 0
    if cap == 0 then
        return false
    end
    local held = astats.incr("held")
    if not held then
        return false
    end
    if held > cap then
        astats.incr("held", -1)
        return false
    end
    local released = false
    local function release()
        if not released then
            released = true
            astats.incr("held", -1)
        end
    end
    local watch = abort.watch(req, release)  -- a client that leaves ends it (499)
    local give_up = now + left - math.max(1, math.min(5, left / 4))
    local gone
    local back = false
    while now < give_up do
        ngx.sleep(math.max(0.001, math.min(_M.THAW_POLL_S, give_up - now)))
        now = ngx_now()
        t = snapshot.current()
        if balancer.count_eligible(t, req.tried, now, req.model) > 0 then
            back = true
            break
        end
        if returning_slots(t, req.model) > 0 then
            gone = nil
        elseif not gone then
            gone = now
        elseif now - gone >= _M.THAW_GONE_S then
            break  -- refused for a while, not one poll's flap: the 503
        end
    end
    if watch then
        abort.unwatch(req, watch)
    end
    release()
    return back
end

-- held() for a request that no node of its model is open to now (as the "eligible" step
-- counts them, req.tried left out): true once it held it until one is back; false at
-- once while one is eligible (a breaker's half-open probe), or when none came back.
function _M.held_if_none(req, t)
    return balancer.count_eligible(t, req.tried, ngx_now(), req.model) == 0 and _M.held(req, t)
end

return _M
