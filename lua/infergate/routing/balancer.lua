-- Node choice (balancer_by_lua). Pure: no I/O, only the worker-local node table
-- (infergate.routing.snapshot) and shared-dict reads/counters.
--
-- Eligible: healthy, state "active", an IP literal address, breaker not open (a
-- half-open node admits exactly one probe at a time), not yet tried by this request.
-- A node whose breaker is ready for its probe is taken first by a request's first
-- attempt (its one probe request; never by a retry), otherwise power of two choices:
-- two distinct nodes are sampled with probability proportional to effective_weight
-- and the one with the lower cost wins (ties: a coin, see below).
--
--   cost = inflight_cost * inflight / (max_concurrency * w)  (this edge's own load;
--                                                             w = effective_weight)
--        + score + (saturated and 1 or 0)                     when the snapshot is fresh
--                                                              and the node has a score
--        | min(latency_ewma_s / latency_norm_s, 1)            otherwise (stale snapshot,
--          + failure_rate                                     static list, score null)
--
-- failure_rate is the EWMA (0-1) of this edge's failed attempts on the node, decaying
-- with a half-life of breaker_cooldown_s (infergate.routing.stats). With a fresh score the
-- control plane's view of the node counts instead, and hard failures are the circuit
-- breaker's business.
--
-- Costs closer than TIE_EPSILON (0.01: 300 ms of latency EWMA at the default 30 s
-- latency_norm_s, or less than one request in flight at max_concurrency 64) count as a
-- tie and a coin decides, so measurement noise does not send everything to one node.
-- With exactly two eligible nodes both are always sampled, so that coin is weighted by
-- effective_weight: weights (and the slow-start ramp after an undrain) still shape the
-- shares.
-- The in-flight term moves with every pick, so an idle-looking score a few seconds old
-- cannot herd all traffic onto one node. Retries: the first call grants as many extra
-- tries as there are other eligible nodes (at most max_tries - 1); on each later call
-- the previous attempt is closed as failed (balancer.get_last_failure) and a node not
-- yet tried is picked. Nothing eligible: the balancer fails and the error page answers
-- 503 no_healthy_upstream.
local ngx_balancer = require("ngx.balancer")
local config = require("infergate.core.config")
local snapshot = require("infergate.routing.snapshot")
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")
local reqctx = require("infergate.core.reqctx")
local deadline = require("infergate.admission.deadline")

local _M = {}

local random = math.random
local min = math.min
local ipairs = ipairs
local log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN

local SATURATED_PENALTY = 1.0
local TIE_EPSILON = 0.01
_M.TIE_EPSILON = TIE_EPSILON

function _M.cost(node, fresh, o, now)
    local name = node.name
    local c = o.inflight_cost * stats.inflight(name) / (node.max_concurrency * node.effective_weight)
    if fresh and node.score then
        c = c + node.score
        if node.saturated then
            c = c + SATURATED_PENALTY
        end
    else
        local lat = stats.latency_ewma_ms(name)
        if lat then
            c = c + min(lat / 1000 / o.latency_norm_s, 1)
        end
        c = c + stats.failure_rate(name, now)
    end
    return c
end

local function usable(node, tried)
    return node.addr and node.healthy and node.state == "active" and not tried[node.name]
end

-- Number of eligible nodes (including one ready for its half-open probe).
function _M.count_eligible(t, tried, now)
    tried = tried or {}
    local n = 0
    for _, node in ipairs(t.nodes) do
        if usable(node, tried) and breaker.allow(node.name, now) then
            n = n + 1
        end
    end
    return n
end

local function weighted(cands, n, total, skip)
    local r = random() * total
    local last
    for i = 1, n do
        local node = cands[i]
        if node ~= skip then
            last = node
            r = r - node.effective_weight
            if r < 0 then
                return node
            end
        end
    end
    return last
end

-- Picks a node for the next attempt. Returns node, is_probe, eligible_count or nil.
-- retry: a later attempt of the request; a retry never spends itself on a half-open
-- probe (the first attempt of another request does that), so the tries granted on
-- the first attempt go to nodes believed good.
function _M.pick(t, tried, now, retry)
    local o = config.get()
    local cands, n, total = {}, 0, 0
    local probes = nil
    for _, node in ipairs(t.nodes) do
        if usable(node, tried) then
            local allow = breaker.allow(node.name, now)
            if allow == "yes" then
                n = n + 1
                cands[n] = node
                total = total + node.effective_weight
            elseif allow == "probe" and not retry then
                probes = probes or {}
                probes[#probes + 1] = node
            end
        end
    end
    if probes then
        for _, node in ipairs(probes) do
            if breaker.take_probe(node.name) then
                return node, true, n + 1
            end
        end
    end
    if n == 0 then
        return nil, false, 0
    end
    if n == 1 then
        return cands[1], false, 1
    end
    local a = weighted(cands, n, total, nil)
    local b = weighted(cands, n, total - a.effective_weight, a)
    local fresh = snapshot.is_fresh(t, now)
    local ca, cb = _M.cost(a, fresh, o, now), _M.cost(b, fresh, o, now)
    local d = ca - cb
    -- With two candidates both are always sampled, so the tie coin carries the weights;
    -- with more, the weighted sampling already does and the coin is fair.
    local pa = 0.5
    if n == 2 then
        pa = a.effective_weight / (a.effective_weight + b.effective_weight)
    end
    if d > TIE_EPSILON or (d >= -TIE_EPSILON and random() >= pa) then
        a = b
    end
    return a, false, n
end

local function fail_no_node(req)
    req.no_node = true
    local ok = pcall(function() ngx.var.infergate_reason = "no_healthy_upstream" end)
    if not ok then
        log(WARN, "infergate: $infergate_reason is not defined in this location")
    end
    return ngx.exit(ngx.ERROR)
end

-- balancer_by_lua entry point.
function _M.run()
    local o = config.get()
    local now = ngx.now()
    local req = reqctx.get() or reqctx.new("inference")
    local attempts = req.attempts
    local n = #attempts
    if n > 0 then
        local prev = attempts[n]
        if not prev.closed then
            local _, status = ngx_balancer.get_last_failure()
            stats.close_attempt(prev, status == 429 and "busy" or "fail", now)
        end
    end
    -- timeouts of this try from the request's deadline; no new try once it has passed
    if not deadline.before_try(req, o, now) then
        return deadline.fail()
    end
    local t = snapshot.current()
    local tried = req.tried
    while true do
        local node, probe, eligible = _M.pick(t, tried, now, n > 0)
        if not node then
            return fail_no_node(req)
        end
        tried[node.name] = true
        local ok, err = ngx_balancer.set_current_peer(node.addr, node.port)
        if ok then
            if n == 0 then
                local more = min(o.max_tries, eligible) - 1
                if more > 0 then
                    local _, terr = ngx_balancer.set_more_tries(more)
                    if terr then
                        log(WARN, "infergate: set_more_tries: ", terr)
                    end
                end
            end
            attempts[n + 1] = stats.open_attempt(node.name, now, probe)
            return
        end
        log(ERR, "infergate: cannot use node ", node.name, " (", node.addr, ":", node.port, "): ", err)
        if probe then
            breaker.neutral(node.name, true)
        end
    end
end

return _M
