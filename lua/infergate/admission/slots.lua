-- Known slots are a hard limit. A node's slots are known when the routing snapshot says
-- so (node.slots: a llama.cpp server's total_slots, or a max_concurrency set to another
-- value than its default, see controlplane/routing/snapshot.py); this edge then never
-- has more requests in flight on it than its slots, counted over all workers
-- (infergate.routing.stats "if:<node>", taken atomically with stats.claim), nor more than
-- its slots less the requests of others its metrics show there while this edge has none
-- (infergate.routing.others: other edges, clients past the gateway).
--
-- For a request whose model has an eligible node with known slots (applies()), the
-- admission step (infergate.admission.shed) picks the node itself (reserve(): the
-- balancer's own choice, infergate.routing.balancer.first_pick, among the nodes with a
-- free slot) and takes the slot; the balancer's first try uses that node
-- (infergate.routing.held). In such a pool a node without known slots counts as full at
-- its max_concurrency; a node found silent (a TTFB outlier or stalled,
-- infergate.routing.outlier) is not picked while a live node is merely full: the request
-- waits for the live node's slot. When no slot is free the request waits at the edge, first come
-- first served (infergate.admission.queue), until one frees or its deadline cannot be
-- met (predict()).
local config = require("infergate.core.config")
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")
local models = require("infergate.routing.models")
local balancer = require("infergate.routing.balancer")
local outlier = require("infergate.routing.outlier")
local freerate = require("infergate.admission.freerate")
local deadline = require("infergate.admission.deadline")
local fit = require("infergate.routing.fit")
local others = require("infergate.routing.others")

local _M = {}

local ipairs = ipairs

-- Eligible for a request of `model`: an IP address, healthy, active, serves the model,
-- breaker not open.
local function open_to(node, model, now)
    return node.addr and node.healthy and node.state == "active" and models.serves(node, model)
        and breaker.allow(node.name, now)
end
_M.open_to = open_to

-- The longest Retry-After (s) of a 429 for `model`: edge.breaker_cooldown_s (at least 1)
-- while one of its nodes is out for ill health (unhealthy in the snapshot, or its circuit
-- breaker open), not drained: a restart may bring it back within the cooldown, sooner
-- than the others' queue drains; else `max_s` (infergate.admission.shed).
function _M.retry_cap(t, model, now, max_s)
    for _, node in ipairs(t.nodes) do
        if node.addr and node.state == "active" and models.serves(node, model)
                and (not node.healthy or not breaker.allow(node.name, now)) then
            local back = math.ceil(config.get().edge.breaker_cooldown_s)
            return back < 1 and 1 or back < max_s and back or max_s
        end
    end
    return max_s
end

-- The most requests `node` runs in a pool with known slots.
local function cap_of(node)
    return node.slots or node.max_concurrency
end

-- The most requests this edge may have in flight on `node` now: its cap less the
-- requests of others its metrics show there (infergate.routing.others).
local function limit_of(node, now, own)
    return cap_of(node) - others.count(node, now, own)
end

-- The slots of `node` free for this edge now (0 or less: none).
local function free_of(node, now)
    local own = stats.inflight(node.name)
    return limit_of(node, now, own) - own
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

-- Whether a node of `model` that is eligible, not found silent and has every slot taken
-- exists (asked only when the pick fell back on a silent node, or free() found one).
local function full_live(t, model, now)
    for _, node in ipairs(t.nodes) do
        if free_of(node, now) <= 0 and open_to(node, model, now)
                and not outlier.is_outlier(node, now) then
            return true
        end
    end
    return false
end

-- Free slots over the eligible nodes of `model` (their cap minus others' requests there
-- and this edge's in flight),
-- and the number of eligible nodes; `tried` (nil: none): nodes left out of the request's
-- choice (infergate.routing.upstream, infergate.routing.ctxfit), not counted. While a
-- node not found silent (a TTFB outlier or stalled) is eligible, the free slots of
-- nodes found silent do not count: reserve()
-- does not pick them, so they must not keep a waiting request from its 429. (Only a
-- node with a free slot is asked whether it is silent; the nodes that are full, only
-- when a silent node's slots would count and no live node has a free slot.)
function _M.free(t, now, model, tried)
    local free, silent, eligible = 0, 0, 0
    for _, node in ipairs(t.nodes) do
        if open_to(node, model, now) and not (tried and tried[node.name]) then
            eligible = eligible + 1
            local f = free_of(node, now)
            if f > 0 then
                free = free + f
                if outlier.is_outlier(node, now) then
                    silent = silent + f
                end
            end
        end
    end
    if silent > 0 and (free > silent or full_live(t, model, now)) then
        free = free - silent
    end
    return free, eligible
end

-- Answers under way first. A relayed stream's retry or continuation that waits for a
-- slot of `model` (infergate.stream.relay) marks it, for MARK_POLLS of its polls and
-- again at each look, with the nodes it leaves out (`tried`: the node it failed on,
-- which may show free slots, e.g. a restarted one); while the mark lasts a new request
-- does not take the last free slot of the other nodes, so the answer already under way
-- gets it instead of waiting behind requests that came later. The mark expires by
-- itself (nothing to give back); the latest marker's nodes left out count.
local MARK_POLLS = 3

function _M.mark_started_waiting(model, now, poll_s, tried)
    local d = ngx.shared[config.DICT_STATS]
    if d then
        local ttl = MARK_POLLS * poll_s + 1
        local names = {}
        for name in pairs(tried or {}) do
            names[#names + 1] = name
        end
        d:set("sx:" .. (model or ""), table.concat(names, "\n"), ttl)
        d:set("sw:" .. (model or ""), now + MARK_POLLS * poll_s, ttl)
    end
end

-- nil, or the nodes the waiting answer leaves out ({name = true}) while the mark lasts.
local function started_waiting(model, now)
    local d = ngx.shared[config.DICT_STATS]
    local v = d and d:get("sw:" .. (model or ""))
    if v == nil or v <= now then
        return nil
    end
    local out = {}
    for name in string.gmatch(d:get("sx:" .. (model or "")) or "", "[^\n]+") do
        out[name] = true
    end
    return out
end

-- A slot the requests at the head of the queue leave because its node would finish them
-- too late goes to the first request behind them that it can finish in time (a younger
-- one, with more time left: reserve(..., "refused")): marked for REFUSED_S.
local REFUSED_S = 1

local function refused(name)
    local d = ngx.shared[config.DICT_STATS]
    if d then
        d:set("uf:" .. name, true, REFUSED_S)
    end
end

-- Whether an eligible node of the request's model, not left out of its choice and not
-- found silent, can finish it within `left` s (infergate.routing.fit), free slot or not.
-- Asked for a node that cannot: any node that can is another one.
local function fits_somewhere(t, req, now, left)
    local tried = req.tried or {}
    for _, node in ipairs(t.nodes) do
        if not tried[node.name] and open_to(node, req.model, now)
                and not outlier.is_outlier(node, now) and fit.fits(node, now, req, left) then
            return true
        end
    end
    return false
end

-- Picks the request's node among those with a free slot, not left out of its choice
-- (req.tried), and takes the slot: true when it did (req.picked set), false when every
-- such slot is taken (or only one is free while an answer under way waits for it, see
-- above), or left for a node that can finish the request in time. `how`: nil, or
-- "refused" (only the slots left so, and only one whose node finishes it in time), or
-- "any" (whichever node finishes it: a request whose wait is over takes a free slot
-- rather than a 429).
function _M.reserve(req, t, now, how)
    -- an answer under way waits and only one slot it can take is free: that one is its
    -- (a node it leaves out may still take this request)
    local waiting = started_waiting(req.model, now)
    local keep = waiting and _M.free(t, now, req.model, waiting) <= 1
    local excluded, tried = {}, req.tried or {}
    local refused_only = how == "refused"
    local d = refused_only and ngx.shared[config.DICT_STATS]
    for _, node in ipairs(t.nodes) do
        if tried[node.name] or free_of(node, now) <= 0 or (keep and not waiting[node.name])
                or (d and not d:get("uf:" .. node.name)) then
            excluded[node.name] = true
        end
    end
    local left = how ~= "any" and deadline.remaining(req, now)
    local elsewhere   -- fits_somewhere, asked once
    for _ = 1, #t.nodes do
        local node, probe = balancer.first_pick(req, t, excluded, now)
        if not node then
            return false
        end
        if not probe and outlier.is_outlier(node, now) and (keep or full_live(t, req.model, now)) then
            -- only nodes found silent have a free slot (the pick never leaves a request
            -- without a node), or a free one of a live node is kept for an answer under
            -- way: wait for a slot on a live one instead
            return false
        end
        local late = not probe and left and not fit.fits(node, now, req, left)
        if late and not refused_only and elsewhere == nil then
            elsewhere = fits_somewhere(t, req, now, left)
        end
        if late and (refused_only or elsewhere) then
            excluded[node.name] = true   -- too late for it, not for another: not here
            if not refused_only then
                refused(node.name)
            end
        elseif stats.claim(node.name, limit_of(node, now)) then
            req.picked = { name = node.name, probe = probe, claimed = true }
            return true
        else
            if probe then
                breaker.neutral(node.name, true)
            end
            excluded[node.name] = true   -- taken by another request meanwhile
        end
    end
    return false
end

-- Predicted completion and wait (s) of a request with `ahead` requests before it in
-- the queue. Each eligible node of `model` with a latency EWMA s frees slots at cap / s
-- per second (with its slots a hard limit, s is its service time) and would finish the
-- request in c = its own high quantile there (infergate.routing.fit.completion: the
-- tail of the node's answer times, capped by the request's max_tokens; a stream whose
-- answers outrun its deadline need only start). The nodes that could finish a request
-- of a whole deadline (c within it; the fastest when none) serve the queue, at the sum
-- of their rates R: a request that has waited takes a node that can still finish it,
-- and the slots it leaves go to the newer arrivals behind it (reserve()). The request is
-- predicted to wait W = (ahead + 1 - free) / R and finish at W + the smallest c of
-- them. `free`: the slots free now, as
-- free() counts them (counted here when nil). When the slots were seen to free up more
-- than FREE_YIELD_RATIO times faster than R (infergate.admission.freerate: the nodes sped
-- up, and the figures learn it only from answers that start after), the rate is the one
-- seen and the request's own time shrinks by the same factor, FREE_YIELD_MAX at most.
-- nil when no eligible node has answered yet.
_M.FREE_YIELD_RATIO = 1.5
_M.FREE_YIELD_MAX = 4
function _M.predict(t, now, req, ahead, free)
    free = free or _M.free(t, now, req.model)
    local whole = deadline.whole_s(req)
    local rate, own, best_rate, best = 0, nil, nil, nil
    for _, node in ipairs(t.nodes) do
        if open_to(node, req.model, now) then
            local c, m = fit.completion(node, now, req)
            if c then
                local r = cap_of(node) / m
                if not whole or c <= whole then
                    rate = rate + r
                    if not own or c < own then
                        own = c
                    end
                end
                if not best or c < best then
                    best, best_rate = c, r
                end
            end
        end
    end
    if not best then
        return nil
    end
    if not own then   -- no node finishes within a whole deadline: the fastest
        rate, own = best_rate, best
    end
    -- slots freeing up far faster than the nodes' figures say (they sped up again):
    -- the prediction yields to what is seen (infergate.admission.freerate)
    local seen = freerate.rate(req.model or "", now)
    if seen and seen > _M.FREE_YIELD_RATIO * rate then
        local f = math.min(seen / rate, _M.FREE_YIELD_MAX)
        rate, own = rate * f, own / f
    end
    local before = ahead + 1 - free
    local wait = before > 0 and before / rate or 0
    return wait + own, wait
end

return _M
