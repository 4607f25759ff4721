-- Known slots are a hard limit. A node's slots are known when the routing snapshot says
-- so (node.slots: a llama.cpp server's total_slots, or a max_concurrency set to another
-- value than its default, see controlplane/routing/snapshot.py); this edge then never
-- has more requests in flight on it than its slots, counted over all workers
-- (infergate.routing.stats "if:<node>", taken atomically with stats.claim).
--
-- For a request whose model has an eligible node with known slots (applies()), the
-- admission step (infergate.admission.shed) picks the node itself (reserve(): the
-- balancer's own choice, infergate.routing.balancer.first_pick, among the nodes with a
-- free slot that can still serve it before its deadline) and takes the slot; the balancer's first try uses that node
-- (infergate.routing.held). In such a pool a node without known slots counts as full at
-- its max_concurrency. When no slot is free the request waits at the edge, first come
-- first served (infergate.admission.queue), until one frees or its deadline cannot be
-- met (predict()).
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")
local models = require("infergate.routing.models")
local balancer = require("infergate.routing.balancer")
local learned = require("infergate.routing.learned")
local speed = require("infergate.routing.speed")

local _M = {}

local ipairs = ipairs

-- Eligible for a request of `model`: an IP address, healthy, active, serves the model,
-- breaker not open.
local function open_to(node, model, now)
    return node.addr and node.healthy and node.state == "active" and models.serves(node, model)
        and breaker.allow(node.name, now)
end
_M.open_to = open_to

-- The most requests this edge may have in flight on `node` in a pool with known slots.
local function cap_of(node)
    return node.slots or node.max_concurrency
end

-- Whether an eligible node of `model` has known slots.
function _M.applies(t, now, model)
    for _, node in ipairs(t.nodes) do
        if node.slots and open_to(node, model, now) then
            return true
        end
    end
    return false
end

-- Free slots over the eligible nodes of `model` (their cap minus this edge's in flight),
-- and the number of eligible nodes.
function _M.free(t, now, model)
    local free, eligible = 0, 0
    for _, node in ipairs(t.nodes) do
        if open_to(node, model, now) then
            eligible = eligible + 1
            local f = cap_of(node) - stats.inflight(node.name)
            if f > 0 then
                free = free + f
            end
        end
    end
    return free, eligible
end

-- Whether a request with `left` s to its deadline would miss it on `node` even with a
-- free slot there: its predicted completion at the node's mean (the work queued ahead
-- of it there and its own service time, infergate.routing.speed.expected_s) is later.
-- The mean, not the tail: a short answer still makes it, and a slot left idle serves
-- nobody (the queue's own rule, predict(), sheds at the tail). False while the node has
-- no service time.
local function too_late(node, left)
    local e = speed.expected_s(node)
    return e ~= nil and e > left
end

-- Picks the request's node among those with a free slot and takes the slot: true when
-- it did (req.picked set), false when every slot is taken (and true as a second value
-- when a free slot was passed over as too late). left (s, optional): the
-- time its deadline leaves; a node it would miss it on, behind the node's own queue
-- (a slow node's free slot while the fast ones are full), is not taken: the request
-- waits at the edge for a slot that serves it in time, or is shed when none can.
function _M.reserve(req, t, now, left)
    local excluded, late = {}, false
    for _, node in ipairs(t.nodes) do
        if stats.inflight(node.name) >= cap_of(node) then
            excluded[node.name] = true
        elseif left and too_late(node, left) then
            excluded[node.name] = true
            late = true
        end
    end
    for _ = 1, #t.nodes do
        local node, probe = balancer.first_pick(req, t, excluded, now)
        if not node then
            return false, late
        end
        if stats.claim(node.name, cap_of(node)) then
            req.picked = { name = node.name, probe = probe, claimed = true }
            return true
        end
        if probe then
            breaker.neutral(node.name, true)
        end
        excluded[node.name] = true   -- taken by another request meanwhile
    end
    return false
end

-- Predicted completion and wait (s) of a request with `ahead` requests before it in
-- the queue: the slots of the eligible nodes of `model` free up at sum(cap / s) per
-- second (s: a node's latency EWMA; with its slots a hard limit that is its service
-- time), and the request then takes its own high quantile (infergate.routing.learned
-- tail_s, capped by its max_tokens). nil when no eligible node has answered yet.
function _M.predict(t, now, req, ahead)
    local rate, tail, free = 0, nil, 0
    for _, node in ipairs(t.nodes) do
        if open_to(node, req.model, now) then
            local lat = stats.latency_ewma_ms(node.name)
            if lat and lat > 0 then
                local s = lat / 1000
                local cap = cap_of(node)
                rate = rate + cap / s
                local own = learned.tail_s(node.name, s, req)
                if not tail or own < tail then
                    tail = own
                end
            end
            local f = cap_of(node) - stats.inflight(node.name)
            free = free + (f > 0 and f or 0)
        end
    end
    if not tail then
        return nil
    end
    local before = ahead + 1 - free
    local wait = before > 0 and before / rate or 0
    return wait + tail, wait
end

return _M
