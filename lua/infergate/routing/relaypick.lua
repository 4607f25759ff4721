-- Node choice for the relay (infergate.stream.relay), which drives streamed requests
-- and, with edge.answer_relay, the others itself over cosockets from the access phase: the same choice as the
-- balancer phase (infergate.routing.balancer: held slot of the admission step, pick,
-- known slots, the request's group of scheme and API key) and the same bookkeeping of
-- the attempt (in-flight count, TTFB outlier, learned concurrency), without
-- ngx.balancer. No I/O.
--
--   next(req, o, now, accept)  node, attempt, eligible count (the node included) for the
--                              request's next attempt, or nil when no node is left (nil,
--                              nil, nil, "full" when the nodes left have every known slot
--                              taken: one may free); accept(node) -> bool narrows the choice
--                              (the relay asks for nodes that can continue an answer)
--   close(att, outcome, now, latency_ms)  ends an attempt (stats.close_attempt,
--                              learned concurrency for "ok", outlier.finished)
--   hold(att, now)             a 500 whose verdict waits (see infergate.stream.leg)
--   other_left(req, now)       true when an untried node could take a retry
--   untry_back(req)            tried nodes seen back since are untried again
--   accepts_all(req, accept)   true when accept takes every usable node of the model
local snapshot = require("infergate.routing.snapshot")
local balancer = require("infergate.routing.balancer")
local stats = require("infergate.routing.stats")
local held = require("infergate.routing.held")
local upstream = require("infergate.routing.upstream")
local outlier = require("infergate.routing.outlier")
local speed = require("infergate.routing.speed")
local affinity = require("infergate.routing.affinity")
local candidates = require("infergate.routing.candidates")
local breaker = require("infergate.routing.breaker")
local backat = require("infergate.routing.backat")
local learned = require("infergate.routing.learned")
local deadline = require("infergate.admission.deadline")

local _M = {}

-- A node of the pick that cannot take the try: marked tried, what it held given back.
local function skip(req, node, probe, claimed)
    req.tried[node.name] = true
    balancer.give_back(node, probe, claimed)
end

-- True when a node left for this request (untried, usable, accepted) has every known
-- slot taken: the pick leaves such a node out, and a slot may free.
local function any_full(req, t, accept, now)
    if not held.enforced() then
        return false
    end
    for _, node in ipairs(t.nodes) do
        if node.slots and candidates.usable(node, req.tried, req.model)
                and breaker.allow(node.name, now) == "yes"
                and stats.inflight(node.name) >= node.slots and (not accept or accept(node)) then
            return true
        end
    end
    return false
end

-- True when a node not tried yet by `req` could take a retry (usable, breaker closed:
-- a retry never takes a half-open probe), now or once one of its slots frees. A request
-- that is not a stream and names its max_tokens counts only a node whose fitted answer
-- time for that many tokens (infergate.routing.learned.answer_s) fits the time its
-- deadline leaves: moved to a node that cannot answer it in time, it would hold a slot
-- there until its deadline (504 all the same), where the node it waits on may resume in
-- time. t: the routing snapshot (nil: the current one). Reads only.
function _M.other_left(req, now, t)
    t = t or snapshot.current()
    local left = not req.stream and learned.max_tokens(req) and deadline.remaining(req, now)
    for _, node in ipairs(t.nodes) do
        if candidates.usable(node, req.tried, req.model)
                and breaker.allow(node.name, now) == "yes"
                and not (left and (learned.answer_s(node.name, req, now) or 0) > left) then
            return true
        end
    end
    return false
end

-- A node this request tried that the control plane saw come back since (restarted, or
-- healthy again: infergate.routing.backat) is not tried any more: what failed there was
-- the node before, and a retry that waits for a slot may take it.
function _M.untry_back(req)
    for _, att in ipairs(req.attempts or {}) do
        local name = att.node
        if req.tried[name] and (backat.get(name) or 0) > att.started then
            req.tried[name] = nil
        end
    end
end

-- True when `accept` (nil: every node) takes every node of the request's model that is
-- usable, tried or not (a retry or a continuation may then wait for any slot of the
-- pool: infergate.admission.slots.mark_started_waiting). Reads only.
function _M.accepts_all(req, accept)
    if not accept then
        return true
    end
    for _, node in ipairs(snapshot.current().nodes) do
        if candidates.usable(node, {}, req.model) and not accept(node) then
            return false
        end
    end
    return true
end

local function choose(req, t, now, n)
    if n == 0 then
        return balancer.first_pick(req, t, req.tried, now)
    end
    return balancer.pick(t, req.tried, now, true, req.model, req.affinity, false)
end

function _M.next(req, o, now, accept)
    local t = snapshot.current()
    local attempts = req.attempts
    local n = #attempts
    local node, probe, eligible, claimed
    if n == 0 and req.picked and not req.picked.used then
        node, probe, eligible, claimed = held.take(req, t, now, balancer.usable,
                                                   balancer.count_eligible)
    end
    local full -- nodes skipped because every slot was taken: not tried, given back below
    for _ = 1, #t.nodes + 1 do
        if not node then
            node, probe, eligible = choose(req, t, now, n)
            if not node then
                break
            end
            claimed = nil
            if node.slots and held.enforced() then
                claimed = stats.claim(node.name, node.slots)
                if not claimed then
                    skip(req, node, probe, nil) -- every slot taken
                    full = full or {}
                    full[#full + 1] = node.name
                    node = nil
                end
            end
        end
        if node and (not upstream.admit(req, node) or (accept and not accept(node))) then
            skip(req, node, probe, claimed)
            node = nil
        elseif node then
            break
        end
    end
    if full then
        for _, name in ipairs(full) do
            req.tried[name] = nil
        end
    end
    if not node then
        return nil, nil, nil, (full or any_full(req, t, accept, now)) and "full" or nil
    end
    req.tried[node.name] = true
    if req.affinity and not req.affinity_live and o.edge.prefix_affinity then
        req.affinity_live = affinity.track(req.affinity)
    end
    local att = stats.open_attempt(node.name, now, probe, claimed)
    attempts[n + 1] = att
    outlier.track(att, req.stream, req)
    speed.track(att)
    return node, att, eligible
end

-- A 500 held (infergate.routing.tries): its in-flight count released, its verdict given
-- by close() once the request's end says whose fault it was.
function _M.hold(att, now)
    stats.hold(att, 500)
    outlier.finished(att, now)
end

-- An attempt's end: its verdict (outcome), answer time (latency_ms, when "ok") and the
-- answer's completion tokens (nil: not known) to the node's learned figures.
function _M.close(att, outcome, now, latency_ms, tokens)
    if stats.close_attempt(att, outcome, now, latency_ms) and outcome == "ok" then
        speed.observe(att, latency_ms, tokens)
    end
    outlier.finished(att, now)
end

return _M
