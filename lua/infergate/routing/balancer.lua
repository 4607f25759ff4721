-- Node choice (balancer_by_lua). Pure: no I/O, only the worker-local node table
-- (infergate.routing.snapshot) and shared-dict reads/counters.
--
-- Eligible: healthy, state "active", an IP literal address, serves the request's model
-- (infergate.routing.models: or its models are unknown), breaker not open (a
-- half-open node admits exactly one probe at a time), not yet tried by this request.
-- A node that is a time-to-first-byte outlier (infergate.routing.outlier: its requests
-- wait far past its usual TTFB and it sent nothing for as long) is left out while other
-- eligible nodes remain.
-- Known slots (node.slots, with load shedding on) are a hard limit: the first try goes to
-- the node the admission step picked and holds a slot on (infergate.admission.slots,
-- infergate.routing.held); a later try takes a slot atomically or skips the node. A
-- retry that finds every other eligible node's slots taken goes over the slots of the
-- cheapest of them when that node queues what is beyond its slots (queues_beyond: a
-- llama.cpp server that reported its slots, or a vLLM, TGI or SGLang node), as nginx
-- would send it there; otherwise it gets 429 nodes_saturated (an OpenAI-compatible
-- server of unknown kind may cut a running request for a new one: llama-cpp-python).
-- A node whose breaker is ready for its probe is taken first by a request's first
-- attempt (its one probe request; never by a retry). A request with an affinity key (a
-- long leading prompt or a session, infergate.routing.affinity) then goes to the first
-- node of its rendezvous order that is within the load bound (a leading prompt this
-- edge has not seen yet: to its first node only when that node costs at most
-- affinity.FIRST_SIGHT_MARGIN more than the cheapest, else to the cheapest; while the
-- edge's traffic shows no reuse of prefixes, affinity.reuse, only when it ties with the
-- cheapest). Otherwise,
-- under edge.node_cost = "expected_delay" (the default) and when every candidate has a
-- fresh score and a service time, the smallest predicted completion wins (least_delay
-- below; infergate.routing.speed.expected_s). Otherwise power of two choices:
-- two distinct nodes are sampled with probability proportional to weight
-- and the one with the lower cost wins (ties: a coin, see below). When no candidate has
-- a fresh score (nodes without metrics, a stale snapshot, the static list) and there are
-- 3 to FULL_SCAN_MAX (16) of them, the cost is made of this edge's own signals only and
-- every candidate is costed instead: the cheapest wins, ties drawn by weight
-- (a shared score a few seconds old is what power of two choices guards against).
--
--   cost = inflight_cost * inflight / (C * w)                (this edge's own load;
--                                                             w = weight)
--        + score + (saturated and 1 or 0)                     when the snapshot is fresh
--                                                              and the node has a score
--        | min(latency_ewma_s / latency_norm_s, 1)            otherwise (stale snapshot,
--          + failure_rate                                     static list, score null)
--
-- C is max_concurrency for a node with a fresh score, and otherwise the concurrency
-- learned from its answers plus one, at most max_concurrency
-- (infergate.routing.speed): on a server that runs one request at a time each request in
-- flight costs about 0.5, whatever max_concurrency says, so latency noise cannot herd.
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
-- weight: weights still shape the shares. Costs, draws and coins use the configured
-- weight, not effective_weight: the slow-start ramp acts once, in
-- infergate.routing.candidates (a node in slow start takes part in a pick with
-- probability effective_weight / weight), so its share ramps linearly; counted in the
-- costs as well, a node at 10 % of its ramp looked ten times as costly and got next to
-- nothing for half the ramp, then most of the traffic at once.
-- The in-flight term moves with every pick, so an idle-looking score a few seconds old
-- cannot herd all traffic onto one node.
--
-- Retries (nginx's proxy_next_upstream: connect errors, timeouts, 500/502/503/504, 429)
-- go to a node not yet tried. Tries are granted one at a time (set_more_tries(1)), so
-- the balancer decides after each failure whether another try makes sense: the first
-- call grants one more try when another node is eligible; a later call grants one more
-- (up to max_tries in all) unless the previous try got a 500 (tried on a second node
-- only; when that node fails it too, nginx passes its answer on, wrapped as JSON when it
-- is not, see infergate.filters). The verdicts on the previous try, and nginx's free
-- retry of a failed kept-alive connection: infergate.routing.tries.
-- Nothing eligible: the balancer fails and the error page answers 503
-- no_healthy_upstream (429 nodes_saturated when the nodes left had every slot taken).
local ngx_balancer = require("ngx.balancer")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local config = require("infergate.core.config")
local snapshot = require("infergate.routing.snapshot")
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")
local reqctx = require("infergate.core.reqctx")
local deadline = require("infergate.admission.deadline")
local outlier = require("infergate.routing.outlier")
local speed = require("infergate.routing.speed")
local room = require("infergate.routing.room")
local affinity = require("infergate.routing.affinity")
local upstream = require("infergate.routing.upstream")
local held = require("infergate.routing.held")
local candidates = require("infergate.routing.candidates")
local tries = require("infergate.routing.tries")

local _M = {}

local random = math.random
local min = math.min
local log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN

local SATURATED_PENALTY = 1.0
local TIE_EPSILON = 0.01
_M.TIE_EPSILON = TIE_EPSILON

function _M.cost(node, fresh, o, now)
    local name = node.name
    local has_score = (fresh and node.score) and true or false
    local c = o.edge.inflight_cost * stats.inflight(name)
        / (speed.concurrency(node, has_score) * node.weight)
    if has_score then
        c = c + node.score
        if node.saturated then
            c = c + SATURATED_PENALTY
        end
    else
        local lat = stats.latency_ewma_ms(name)
        if lat then
            c = c + min(lat / 1000 / o.scoring.latency_norm_s, 1)
        end
        c = c + stats.failure_rate(name, now)
    end
    return c
end

_M.usable = candidates.usable
_M.count_eligible = candidates.count_eligible

local function weighted(cands, n, total, skip)
    local r = random() * total
    local last
    for i = 1, n do
        local node = cands[i]
        if node ~= skip then
            last = node
            r = r - node.weight
            if r < 0 then
                return node
            end
        end
    end
    return last
end

-- Local signals only (no fresh score among the candidates): they are this edge's own and
-- move with every pick, so every candidate is costed and the cheapest taken (costs
-- within TIE_EPSILON of the cheapest: drawn in proportion to weight).
local FULL_SCAN_MAX = 16
_M.FULL_SCAN_MAX = FULL_SCAN_MAX

local function any_score(cands, n, fresh)
    if not fresh then
        return false
    end
    for i = 1, n do
        if cands[i].score then
            return true
        end
    end
    return false
end

-- The cheapest of cands[1..n] (ties within TIE_EPSILON drawn by weight) and
-- its cost.
local function least_cost(cands, n, fresh, o, now)
    local costs, best = {}, nil
    for i = 1, n do
        local c = _M.cost(cands[i], fresh, o, now)
        costs[i] = c
        if not best or c < best then
            best = c
        end
    end
    local total = 0
    for i = 1, n do
        if costs[i] <= best + TIE_EPSILON then
            total = total + cands[i].weight
        end
    end
    local r = random() * total
    local last, last_cost
    for i = 1, n do
        if costs[i] <= best + TIE_EPSILON then
            last, last_cost = cands[i], costs[i]
            r = r - last.weight
            if r < 0 then
                return last, last_cost
            end
        end
    end
    return last, last_cost
end

-- Delay cost (s) of `node`: infergate.routing.speed.expected_s over weight,
-- doubled while the node is saturated, times
-- 1 + this edge's failure rate of it; nil without a service time.
function _M.delay_cost(node, fresh, now)
    local e = speed.expected_s(node)
    if not e then
        return nil
    end
    local c = e / node.weight
    if fresh and node.saturated then
        c = c * (1 + SATURATED_PENALTY)
    end
    return c * (1 + stats.failure_rate(node.name, now))
end

-- Load of `node` relative to its capacity: what breaks near-ties of the delay cost.
local function relative_load(node)
    return (stats.inflight(node.name) + 1) / (speed.batch(node) * node.weight)
end

-- edge.node_cost = "expected_delay": the candidate with the smallest delay cost (every
-- one costed up to FULL_SCAN_MAX, else the better of two sampled by weight),
-- among those with room (infergate.routing.room) when any has.
-- Costs within DELAY_TIE (relative) of the best count as a tie, won by the lowest
-- in-flight per unit of concurrency (a coin by weight when equal), so equal
-- idle nodes share the load as least_conn would. nil (the load cost decides) when a
-- candidate has no service time yet, or no fresh score: a node without metrics (kind
-- openai) often runs one request at a time, so it answers too rarely for its service
-- time to follow a recovery, and a stale slow history would herd a burst onto the
-- other nodes; the learned concurrency in the load cost is made for those.
local DELAY_TIE = 0.1
_M.DELAY_TIE = DELAY_TIE

function _M.least_delay(cands, n, total, fresh, now)
    if not fresh then
        return nil
    end
    local pool, m = cands, n
    if n > FULL_SCAN_MAX then
        local a = weighted(cands, n, total, nil)
        pool, m = { a, weighted(cands, n, total - a.weight, a) }, 2
    end
    local full = room.full(pool, m)   -- no queueing while a candidate has room
    local costs, best = {}, nil
    for i = 1, m do
        local c = pool[i].score and _M.delay_cost(pool[i], fresh, now)
        if not c then
            return nil
        end
        if not (full and full[i]) then
            costs[i] = c
            if not best or c < best then
                best = c
            end
        end
    end
    local pick, pick_load, weight_sum = nil, nil, 0
    for i = 1, m do
        if costs[i] and costs[i] <= best * (1 + DELAY_TIE) then
            local node = pool[i]
            local l = relative_load(node)
            if not pick or l < pick_load - 1e-9 then
                pick, pick_load, weight_sum = node, l, node.weight
            elseif l <= pick_load + 1e-9 then
                weight_sum = weight_sum + node.weight
                if random() * weight_sum < node.weight then
                    pick = node
                end
            end
        end
    end
    return pick
end

-- Picks a node for the next attempt. Returns node, is_probe, eligible_count or nil.
-- retry: a later attempt of the request; a retry never spends itself on a half-open
-- probe (the first attempt of another request does that), so the tries granted on
-- the first attempt go to nodes believed good. model: the request's model (nil: any).
-- key: the request's affinity key (infergate.routing.affinity; nil: none), which takes
-- the place of the cost-based choice among two or more candidates; first: the key is a
-- leading prompt this edge has not seen (affinity.first_sight), whose first node must not
-- cost much more than the cheapest (nothing more while the traffic shows no reuse:
-- affinity.reuse below affinity.REUSE_MIN).
function _M.pick(t, tried, now, retry, model, key, first)
    local o = config.get()
    local cands, n, total, probe, eligible = candidates.gather(t, tried, now, retry, model, o)
    if probe then
        return probe, true, eligible
    end
    if n == 0 then
        return nil, false, 0
    end
    if n == 1 then
        return cands[1], false, eligible
    end
    local fresh = snapshot.is_fresh(t, now)
    if key and o.edge.prefix_affinity then
        if first and not retry then
            -- while the traffic shows no reuse, the key's first node only on a tie
            local margin = affinity.FIRST_SIGHT_MARGIN
            if affinity.reuse(now) < affinity.REUSE_MIN then
                margin = TIE_EPSILON
            end
            local cheapest, lowest = least_cost(cands, n, fresh, o, now)
            local top = affinity.top(cands, n, key)
            if cheapest ~= top and _M.cost(top, fresh, o, now) > lowest + margin then
                affinity.heat(key, now) -- counted: its next request follows the key
                return cheapest, false, eligible
            end
        end
        return affinity.choose(cands, n, key, o, fresh, now, retry), false, eligible
    end
    if o.edge.node_cost == "expected_delay" then
        local node = _M.least_delay(cands, n, total, fresh, now)
        if node then
            return node, false, eligible
        end
    end
    if n > 2 and n <= FULL_SCAN_MAX and not any_score(cands, n, fresh) then
        return least_cost(cands, n, fresh, o, now), false, eligible
    end
    local a = weighted(cands, n, total, nil)
    local b = weighted(cands, n, total - a.weight, a)
    local ca, cb = _M.cost(a, fresh, o, now), _M.cost(b, fresh, o, now)
    local d = ca - cb
    -- With two candidates both are always sampled, so the tie coin carries the weights;
    -- with more, the weighted sampling already does and the coin is fair.
    local pa = 0.5
    if n == 2 then
        pa = a.weight / (a.weight + b.weight)
    end
    if d > TIE_EPSILON or (d >= -TIE_EPSILON and random() >= pa) then
        a = b
    end
    return a, false, eligible
end

local place

-- Whether a node queues the requests beyond its known slots itself (a retry may then go
-- over them): a llama.cpp server that reported them (slots_source "server": its requests
-- wait for a free slot), or a node of a batching kind (vLLM, TGI, SGLang: beyond
-- --max-num-seqs a request waits in the engine's queue). Not a node of kind "openai" or
-- "json" with configured slots: a server of unknown kind may not queue
-- (llama-cpp-python interrupts a running request for a new one).
local QUEUEING_KINDS = { vllm = true, tgi = true, sglang = true }
local function queues_beyond(node)
    return node.slots_source == "server" or QUEUEING_KINDS[node.kind] == true
end

-- A picked node that will not take the try: its half-open probe (probe) and the slot it
-- held for the request (claimed) given back.
function _M.give_back(node, probe, claimed)
    if probe then
        breaker.neutral(node.name, true)
    end
    if claimed then
        stats.release({ node = node.name })
    end
end

local function fail_no_node(req)
    req.no_node = true
    local reason = req.slots_full and "nodes_saturated" or "no_healthy_upstream"
    local ok = pcall(function() ngx.var.infergate_reason = reason end)
    if not ok then
        log(WARN, "infergate: $infergate_reason is not defined in this location")
    end
    return ngx.exit(ngx.ERROR)
end

-- The request's first pick, as run() makes it: counts the request for prefix affinity
-- once and tells a leading prompt not seen yet (`first`). excluded: node names left out
-- (taken as tried). Returns what pick() returns.
function _M.first_pick(req, t, excluded, now)
    local o = config.get()
    local first = req.first_sight
    if first == nil then
        first = false
        if o.edge.prefix_affinity then
            first = affinity.first_sight(req.affinity_kind, req.affinity, now)
        end
        req.first_sight = first
    end
    return _M.pick(t, excluded, now, false, req.model, req.affinity, first)
end

-- Picks this try's node and sets it as the peer; a node nginx refuses (a bad address),
-- or one whose known slots are all taken (infergate.admission.slots), is skipped for the
-- next pick (a tail call, not a loop: the common path stays free of loops that exit on
-- their first pass, which LuaJIT blacklists together with every trace that reaches them).
function place(req, o, now, n, grant, first)
    local tried = req.tried
    local node, probe, eligible, claimed
    if n == 0 and req.picked and not req.picked.used then
        node, probe, eligible, claimed = held.take(req, snapshot.current(), now, candidates.usable,
                                                   _M.count_eligible)
    end
    if not node then
        node, probe, eligible = _M.pick(snapshot.current(), tried, now, n > 0, req.model,
                                        req.affinity, first)
        if not node and req.free_try and not req.free_try_used then
            -- nginx's own retry of a kept-alive connection the node had closed (no try
            -- granted for it): the same node again, on a new connection, once
            req.free_try_used = true
            tried[tries.node_of(req, n)] = nil
            return place(req, o, now, n, grant, first)
        end
        local over = req.over_slots
        if not node and over then
            -- a retry with every slot of the nodes left taken: over the cheapest's slots
            node, probe, eligible, req.over_slots = over, false, 1, false
        elseif not node then
            return fail_no_node(req)
        elseif node.slots and held.enforced() then
            claimed = stats.claim(node.name, node.slots)
            if not claimed then
                tried[node.name] = true   -- every slot taken: not from a new request
                req.slots_full = true
                if probe then
                    breaker.neutral(node.name, true)
                end
                if n > 0 and over == nil and queues_beyond(node) then
                    req.over_slots = node
                end
                return place(req, o, now, n, grant, first)
            end
        end
    end
    tried[node.name] = true
    local ok, err = false, "not of this request's scheme and API key (infergate.routing.upstream)"
    if upstream.admit(req, node) then
        ok, err = ngx_balancer.set_current_peer(node.addr, node.port)
    end
    if not ok then
        log(ERR, "infergate: cannot use node ", node.name, " (", node.addr, ":", node.port, "): ", err)
        _M.give_back(node, probe, claimed)
        return place(req, o, now, n, grant, first)
    end
    local attempts = req.attempts
    -- eligible counts the node just picked: another one is left for a next try
    local can_retry = grant and eligible > 1 and n + 1 < o.edge.max_tries
    req.granted = can_retry
    if can_retry then
        local _, terr = ngx_balancer.set_more_tries(1)
        if terr then
            log(WARN, "infergate: set_more_tries: ", terr)
        end
    end
    if req.affinity and not req.affinity_live and o.edge.prefix_affinity then
        req.affinity_live = affinity.track(req.affinity)
    end
    -- a probe of a silent outlier with another node to retry on waits only part of its
    -- time (infergate.admission.deadline.probe_read), never less than twice its predicted
    -- completion there (queued behind others on a node that slowed down is not stalled)
    local thr = can_retry and outlier.probe_threshold(node.name, req.stream, o)
    if thr and not probe then
        local e = speed.expected_s(node)
        if e and e > thr then
            thr = e
        end
    end
    attempts[n + 1] = stats.open_attempt(node.name, now, probe, claimed)
    outlier.track(attempts[n + 1], req.stream, req)
    if thr then
        deadline.probe_read(req, o, now, thr)
    end
    speed.track(attempts[n + 1])
end

-- balancer_by_lua entry point.
function _M.run()
    local o = config.get()
    local now = ngx_now()
    local req = reqctx.get() or reqctx.new("inference")
    local attempts = req.attempts
    local n = #attempts
    local grant = true
    if n > 0 then
        local _, status = ngx_balancer.get_last_failure()
        grant = tries.settle(req, attempts[n], status, now)
    end
    -- timeouts of this try from the request's deadline; no new try once it has passed
    if not deadline.before_try(req, o, now, n > 0) then
        return deadline.fail()
    end
    req.over_slots, req.slots_full = nil, nil
    local first = false
    if n == 0 and o.edge.prefix_affinity then
        first = req.first_sight
        if first == nil then
            first = affinity.first_sight(req.affinity_kind, req.affinity, now)
        end
    end
    return place(req, o, now, n, grant, first)
end

return _M
