-- Admission control: load shedding (an access step), plus the hooks the shared
-- phases call for auth, rate limits and deadlines.
--
-- Access pipeline (infergate.access): method -> auth -> body -> ratelimit -> [cache
-- lookup] -> eligible -> admission. A cache hit answers before "eligible", so it never
-- waits here and is served even when every node is saturated.
--
-- Shedding: a node has capacity when it is eligible (healthy, active, an IP address,
-- breaker not open) and neither
--   * saturated in a fresh snapshot (queue depth or KV-cache use over the
--     [scoring] saturation_queue / saturation_kv caps, computed by the control plane), nor
--   * at its max_concurrency in this edge's own in-flight count.
-- When no eligible node has capacity, the request waits up to admission.max_wait_ms
-- (never past its deadline), checking again every admission.poll_ms with ngx.sleep,
-- then gets 429 with Retry-After = admission.retry_after_s and
-- {"type": "server_overloaded", "code": "nodes_saturated"}: a quick, retryable answer
-- instead of a timeout. Only inference requests are shed (GET /v1/models is not).
-- Counted as "shed" (infergate.admission.stats).
local options = require("infergate.admission.options")
local snapshot = require("infergate.routing.snapshot")
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")
local deadline = require("infergate.admission.deadline")
local ratelimit = require("infergate.admission.ratelimit")
local astats = require("infergate.admission.stats")

local _M = {}

local ipairs = ipairs
local pairs = pairs
local tostring = tostring

-- "free" (some eligible node has capacity), "saturated" (every eligible node is
-- saturated) or "none" (no eligible node: the "eligible" step answers 503).
function _M.capacity(t, now)
    local fresh = snapshot.is_fresh(t, now)
    local eligible = 0
    for _, node in ipairs(t.nodes) do
        if node.addr and node.healthy and node.state == "active" and breaker.allow(node.name, now) then
            eligible = eligible + 1
            local full = (fresh and node.saturated)
                or stats.inflight(node.name) >= node.max_concurrency
            if not full then
                return "free"
            end
        end
    end
    if eligible == 0 then
        return "none"
    end
    return "saturated"
end

-- Access step: nil to continue, or a 429 error table.
function _M.step_shed(req)
    local o = options.get().shed
    if not o.enabled or req.route ~= "inference" then
        return nil
    end
    ngx.update_time()
    local now = ngx.now()
    local wait_s = o.max_wait_ms / 1000
    local left = deadline.remaining(req, now)
    if left and left < wait_s then
        wait_s = left > 0 and left or 0
    end
    local give_up = now + wait_s
    local poll_s = o.poll_ms / 1000
    local waited = false
    while true do
        local state = _M.capacity(snapshot.refresh(), now)
        if state ~= "saturated" then
            if waited then
                astats.incr("waiting", -1)
                req.admission_wait_ms = (now - (give_up - wait_s)) * 1000
            end
            return nil
        end
        if now >= give_up then
            break
        end
        if not waited then
            astats.incr("waiting")
        end
        local step = give_up - now
        if step > poll_s then
            step = poll_s
        end
        if step < 0.001 then
            step = 0.001  -- ngx.sleep(0) only yields (and warns): wait at least 1 ms
        end
        ngx.sleep(step)
        waited = true
        ngx.update_time()
        now = ngx.now()
    end
    if waited then
        astats.incr("waiting", -1)
    end
    astats.incr("shed")
    local headers = { ["Retry-After"] = tostring(o.retry_after_s) }
    if req.headers_out then
        for k, v in pairs(req.headers_out) do
            headers[k] = v
        end
    end
    return {
        status = 429,
        message = "Every inference node is saturated; the request was not admitted. Retry after "
            .. o.retry_after_s .. " s.",
        type = "server_overloaded",
        code = "nodes_saturated",
        headers = headers,
    }
end

-- Log phase hook: rate-limit correction from the real token usage (no I/O here).
function _M.log(req)
    ratelimit.log(req)
end

-- Counters for the edge stats and the status endpoint.
function _M.counters()
    return astats.all()
end

return _M
