-- Admission control: load shedding (an access step), plus the hooks the shared
-- phases call for auth, rate limits and deadlines.
--
-- Access pipeline (infergate.access): method -> auth -> body -> ratelimit -> [cache lookup]
-- -> eligible -> admission; a cache hit answers before "eligible", never waiting here.
--
-- Known slots (infergate.admission.slots): when an eligible node of the request's model has known
-- slots, the slots are a hard limit and the rules below give way to the edge queue (wait_for_slot):
-- a free slot is taken at once, else the request waits in arrival order until one frees for it, and
-- gets the 429 as soon as its predicted completion at the tail of answer times misses its deadline
-- (a stream's whole answer too, unless the node's answers outrun its deadline). A slot on a node
-- that would finish the request too late is left for one that would not (slots.reserve), and goes
-- to a request behind it with time enough.
-- When every node of its model leaves the pool while it waits, it is held for them as at the
-- "eligible" step (infergate.admission.thaw).
--
-- Otherwise, shedding per model: a node has capacity when it is eligible (healthy,
-- active, an IP address, breaker not open, serves the request's model:
-- infergate.routing.models) and neither
--   * saturated in a fresh snapshot (queue depth or KV-cache use over the
--     [scoring] saturation_queue / saturation_kv caps, computed by the control plane), nor
--   * at its max_concurrency in this edge's own in-flight count.
-- A request is never shed while a node has capacity (no prediction overrides that). When none has,
-- with a deadline (infergate.admission.deadline), a request is shed only when even the best node
-- cannot finish it in time: when the smallest predicted completion
-- (infergate.routing.speed.predicted: the work ahead at this edge over the node's learned
-- concurrency at the node's latency EWMA, plus its own time at the node's high quantile,
-- infergate.routing.learned.tail_s, capped by its max_tokens) is within the time left, it is
-- admitted and queues at the node. Nodes without latency history, and nodes saturated in a fresh
-- snapshot, predict nothing; when none predicts, the wait below applies. With edge.node_cost =
-- "expected_delay", a fresh snapshot and a service time for every eligible node
-- (infergate.routing.balancer.delay_cost: the predicted completion the balancer itself picks on,
-- its own part taken at the tail: infergate.routing.fit.extra), that cost decides instead:
-- admitted while the best is at most admission.deadline_fraction (1) of the time left, shed past
-- it, never sent where it is predicted to time out.
-- A request that is shed gets Retry-After = the best predicted wait, rounded up (at least 1 s, at
-- most RETRY_AFTER_MAX_S: a wait predicted from a node that has slowed down or stopped says little
-- about when it recovers; at most edge.breaker_cooldown_s while a node of the model is out for ill
-- health, which a restart brings back sooner than the others' queue drains; admission.retry_after_s
-- when nothing predicts). When no eligible node has capacity, the request waits up to
-- admission.max_wait_ms (never past its deadline), checking again every admission.poll_ms with
-- ngx.sleep, then gets 429 (Retry-After = admission.retry_after_s, {"type": "server_overloaded",
-- "code": "nodes_saturated"}): a quick, retryable answer instead of a timeout.
-- Only requests that take a slot are shed: the routes "inference" and "api" (infergate.access).
-- While nginx shuts down (SIGQUIT) a waiting request gets 503 {"code": "shutting_down"} with
-- Retry-After: 1 at its next check, instead of being held to the end of the shutdown; on a reload
-- it waits on in its old worker, as nginx finishes its requests (core.closing). Counted: "shed".
local ngxapi = require("infergate.core.ngxapi")
local abort = require("infergate.core.abort")
local ngx_now = ngxapi.now
local snapshot = require("infergate.routing.snapshot")
local stats = require("infergate.routing.stats")
local deadline = require("infergate.admission.deadline")
local ratelimit = require("infergate.admission.ratelimit")
local astats = require("infergate.admission.stats")
local speed = require("infergate.routing.speed")
local fit = require("infergate.routing.fit")
local balancer = require("infergate.routing.balancer")
local config = require("infergate.core.config")
local slots = require("infergate.admission.slots")
local queue = require("infergate.admission.queue")
local held = require("infergate.routing.held")
local learned = require("infergate.routing.learned")
local fairqueue = require("infergate.admission.fairqueue")
local thaw = require("infergate.admission.thaw")
local fairshare = require("infergate.admission.fairshare")
local lengths = require("infergate.routing.lengths")
local freerate = require("infergate.admission.freerate")
local usage = require("infergate.admission.usage")
local wake = require("infergate.admission.wake")
local ngx_var = ngxapi.var

local _M = {}

local RETRY_AFTER_MAX_S = 30
_M.RETRY_AFTER_MAX_S = RETRY_AFTER_MAX_S

local ipairs, pairs, tostring, tonumber = ipairs, pairs, tostring, tonumber

local open_to = slots.open_to

-- "free" (some eligible node has capacity), "saturated" (every eligible node is
-- saturated) or "none" (no eligible node: the "eligible" step answers 503), among the
-- nodes that serve `model` (nil: any).
function _M.capacity(t, now, model)
    local fresh = snapshot.is_fresh(t, now)
    local eligible = 0
    for _, node in ipairs(t.nodes) do
        if open_to(node, model, now) then
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

-- Best predicted (completion, wait) in s over the eligible nodes of `model`, or nil.
-- req (optional): the request's own time is then the node's high quantile
-- (infergate.routing.learned.tail_s, capped by its max_tokens), not its mean; a stream's
-- too, unless its answers outrun its whole deadline (infergate.admission.deadline.own_s).
function _M.best_prediction(t, now, model, req)
    local fresh = snapshot.is_fresh(t, now)
    local best, best_wait
    for _, node in ipairs(t.nodes) do
        -- a node saturated in a fresh snapshot (its own queue, which may hold other
        -- edges' requests, is over the cap) predicts nothing: it stays shed
        if not (fresh and node.saturated) and open_to(node, model, now) then
            local done, wait = speed.predicted(node, (fresh and node.score) and true or false)
            if done and req then
                done = wait + deadline.own_s(req, learned.tail_s(node.name, done - wait, req, now))
            end
            if done and (not best or done < best) then
                best, best_wait = done, wait
            end
        end
    end
    return best, best_wait
end

-- The smallest delay cost (s) over the eligible nodes of `model` (nil: any), or nil when
-- it does not apply: node_cost is not expected_delay, the snapshot is stale, no node is
-- eligible and unsaturated, or one of them has no fresh score or no service time yet.
-- A node saturated in the snapshot (over the [scoring] caps) offers nothing here, as in
-- the rule above: the operator's caps still shed. req (optional): its own time is taken
-- at the node's high quantile (infergate.routing.fit.extra).
function _M.best_delay(t, now, model, req)
    if config.get().edge.node_cost ~= "expected_delay" or not snapshot.is_fresh(t, now) then
        return nil
    end
    local best
    for _, node in ipairs(t.nodes) do
        if not node.saturated and open_to(node, model, now) then
            local c = node.score and balancer.delay_cost(node, true, now)
            if not c then
                return nil
            end
            if req then
                c = c + fit.extra(node, now, req)
            end
            if not best or c < best then
                best = c
            end
        end
    end
    return best
end

local exiting = require("infergate.core.closing").now

-- The admission state of the request now: "none", "saturated", "in_time" or what
-- capacity() says. left: the seconds its deadline leaves (nil: none), counted from
-- give_up - wait_s.
local function admit_state(req, o, t, now, left, give_up, wait_s)
    local state = _M.capacity(t, now, req.model)
    if state ~= "saturated" then
        return state   -- never shed while an eligible node is below its max_concurrency
    end
    local delay = left and _M.best_delay(t, now, req.model, req)
    if delay then
        local elapsed = now - (give_up - wait_s)
        state = delay <= o.deadline_fraction * (left - elapsed) and "in_time" or "saturated"
    elseif state == "saturated" and left then
        -- deadline-aware: admitted when the best node can still finish it in time
        local done = _M.best_prediction(t, now, req.model, req)
        if done and done <= left - (now - (give_up - wait_s)) then
            state = "in_time"
        end
    end
    return state
end

-- The 503 of a request that waited while nginx shuts down (SIGQUIT: `nginx -s quit`, a
-- stop of `infergate up`): it would be held to the end of the grace period and then cut.
local function shutting_down(waited)
    if waited then
        astats.incr("waiting", -1)
    end
    astats.incr("shed")
    return {
        status = 503,
        message = "The gateway is shutting down; the request was not admitted. Retry "
            .. "after 1 s (another edge, or this one once it is back).",
        type = "service_unavailable",
        code = "shutting_down",
        headers = { ["Retry-After"] = "1" },
    }
end

-- The 429 of a request not admitted within its wait (o: the shed options; wait: the
-- predicted wait, s, when the caller has one).
local function shed_answer(req, o, now, waited, wait)
    if waited then
        astats.incr("waiting", -1)
    end
    astats.incr("shed")
    local retry_after = o.retry_after_s
    if not wait then
        local _
        _, wait = _M.best_prediction(snapshot.current(), now, req.model)
    end
    if wait then
        retry_after = math.max(1, math.min(math.ceil(wait),
            slots.retry_cap(snapshot.current(), req.model, now, RETRY_AFTER_MAX_S)))
    end
    local headers = { ["Retry-After"] = tostring(retry_after) }
    if req.headers_out then
        for k, v in pairs(req.headers_out) do
            headers[k] = v
        end
    end
    return {
        status = 429,
        message = "Every inference node is saturated; the request was not admitted. Retry after "
            .. retry_after .. " s.",
        type = "server_overloaded",
        code = "nodes_saturated",
        headers = headers,
    }
end

-- One pause of the wait: up to poll_s, never past give_up, at least 1 ms (ngx.sleep(0)
-- only yields, and warns); `near`: a request near the head of the slot queue, woken
-- when a slot frees in this worker (infergate.admission.wake).
local function pause(give_up, now, poll_s, near)
    local step = math.max(math.min(give_up - now, poll_s), 0.001)
    if near then
        return wake.sleep(step)
    end
    ngx.sleep(step)
end

-- Whether a request waiting for a slot since `start` gives up now: past give_up, or its
-- deadline (`left` s at start) cannot be met by the predicted completion
-- (infergate.admission.slots.predict), which never counts while a slot is free (`free`).
-- Returns true/false and the predicted wait (s).
local function slot_hopeless(req, t, now, start, left, give_up, ahead, free)
    local done, wait = slots.predict(t, now, req, ahead, free)
    if now >= give_up then
        return true, wait
    end
    if free > 0 then
        return false, wait
    end
    return (left and done and (now - start) + done > left) or false, wait
end

-- The two lines a request waits in for a slot, w = {pool, ticket, flow} per request:
-- FIFO (infergate.admission.queue, arrival order per pool) and FAIR (the fair share,
-- infergate.admission.fairqueue: per tenant and class). rank(w) = the requests served
-- before it (FAIR: or only those ahead in its own flow when they fill the free slots);
-- step = how long it sleeps between two looks.
local FIFO, FAIR, AGAIN = {}, {}, {}

function FIFO.busy(w)
    return not queue.empty(w.pool)
end

function FIFO.join(w, _, poll_s)
    w.ticket = queue.join(w.pool, poll_s)
    return w.ticket
end

function FIFO.rank(w, now, poll_s, _)
    local a = queue.ahead(w.pool, w.ticket, now)
    queue.alive(w.pool, w.ticket, poll_s)
    return a
end

function FIFO.leave(w, now)
    queue.leave(w.pool, w.ticket, now)
end

function FAIR.busy(w)
    return fairqueue.any_waiting(w.pool)
end

function FAIR.join(w, o, poll_s)
    w.ticket = fairqueue.join(w.pool, w.flow, o.tenant_queue_max, poll_s)
    return w.ticket
end

function FAIR.rank(w, now, poll_s, free)
    return fairqueue.position(w.pool, w.flow, w.ticket, now, poll_s, free)
end

function FAIR.leave(w, now)
    fairqueue.leave(w.pool, w.flow, w.ticket, now)
end

-- A request with many others before it, in either line, polls less often (up to
-- FAIR_STEP_MAX x poll, and at most half the TTL of its alive mark,
-- infergate.admission.queue.alive_ttl_s, so a long sleep never makes it look gone): the
-- requests ahead take the next free slots anyway, and hundreds of waiting requests
-- polling every few milliseconds would keep the worker busy.
local FAIR_STEP_MAX = 10
function FAIR.step(poll_s, ahead, free)
    local behind = ahead - free
    if behind <= 0 then
        return poll_s
    end
    return math.min(poll_s * math.min(FAIR_STEP_MAX, 1 + behind / 8),
                    queue.alive_ttl_s(poll_s) / 2)
end
FIFO.step = FAIR.step   -- the same in arrival order
_M.FAIR_STEP = FAIR.step
-- A client that leaves while waiting leaves the line at once (infergate.core.abort). No
-- closure in wait_for_slot or admit: LuaJIT compiles no return from a function with one.
local function unwait() astats.incr("waiting", -1) end
local function watch_line(req, line, w)
    return abort.watch(req, function() line.leave(w, ngx_now()) unwait() end)
end

-- Admission in a pool with known slots (infergate.admission.slots): a free slot is
-- taken at once when nobody waits; otherwise the request waits at the edge
-- (FIFO: in arrival order; FAIR: by the fair share) until a slot frees for it, or gets
-- the 429 as soon as its deadline cannot be met (without a deadline: after
-- admission.max_wait_ms; without a prediction: after half the time left, at least
-- max_wait_ms; under the fair share that wait times the class's WAIT_FACTOR, never past
-- the deadline). A fair flow already holding admission.tenant_queue_max: the fast 429.
local function wait_for_slot(req, o, t, now, left)
    local line, w, factor = FIFO, { pool = req.model or "" }, 1
    if fairshare.on(o) then
        local class = fairshare.share(req, o)
        line, factor = FAIR, fairshare.WAIT_FACTOR[class]
        w.flow = fairqueue.flow(req.tenant or "", class)
    end
    if not line.busy(w) and slots.reserve(req, t, now) then
        return nil
    end
    local start, poll_s = now, o.poll_ms / 1000
    local wait_s = o.max_wait_ms / 1000
    if left then
        wait_s = math.max(wait_s, slots.predict(t, now, req, 0) and left or left / 2)
    end
    if factor ~= 1 then
        wait_s = wait_s * factor
        if left and wait_s > left then
            wait_s = left
        end
    end
    local give_up = now + wait_s
    if not line.join(w, o, poll_s) then
        astats.incr("shed")
        return fairshare.queue_full(o)
    end
    astats.incr("waiting")
    local gone = watch_line(req, line, w)
    while true do
        local free, eligible = slots.free(t, now, req.model, req.tried)
        local ahead = line.rank(w, now, poll_s, free)
        if eligible == 0 or (ahead < free and slots.reserve(req, t, now))
                or (ahead >= free and free > 0 and slots.reserve(req, t, now, "refused"))
                or (free > 0 and now >= give_up and slots.reserve(req, t, now, "any")) then
            abort.unwatch(req, gone)
            line.leave(w, now)
            astats.incr("waiting", -1)
            req.admission_wait_ms = (now - start) * 1000
            -- its nodes froze while it waited: held as a new arrival, else the 503
            return eligible == 0 and thaw.held_if_none(req, t) and AGAIN or nil
        end
        local stop, wait = slot_hopeless(req, t, now, start, left, give_up, ahead, free)
        if stop or exiting() then
            abort.unwatch(req, gone)
            line.leave(w, now)
            if stop then
                return shed_answer(req, o, now, true, wait)
            end
            return shutting_down(true)
        end
        pause(give_up, now, line.step(poll_s, ahead, free), ahead - free < wake.NEAR)
        ngx.update_time()
        now = ngx_now()
        t = snapshot.refresh()
    end
end

local function admit(req, o)
    ngx.update_time()
    local now = ngx_now()
    local left0 = deadline.remaining(req, now)
    local t0 = snapshot.refresh()
    if slots.applies(t0, now, req.model) then
        req.slot_pool = true
        local e = wait_for_slot(req, o, t0, now, left0)
        if e == AGAIN then return admit(req, o) end
        return e
    end
    local wait_s = o.max_wait_ms / 1000
    local left = deadline.remaining(req, now)
    if left and left < wait_s then
        wait_s = left > 0 and left or 0
    end
    local give_up = now + wait_s
    local poll_s = o.poll_ms / 1000
    local waited, gone = false, nil
    while true do
        local t = snapshot.refresh()
        local state = admit_state(req, o, t, now, left, give_up, wait_s)
        if state ~= "saturated" or now >= give_up or exiting() then
            abort.unwatch(req, gone)
        end
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
        if exiting() then
            return shutting_down(waited)
        end
        if not waited then
            astats.incr("waiting")
            gone = abort.watch(req, unwait)
        end
        pause(give_up, now, poll_s)
        waited = true
        ngx.update_time()
        now = ngx_now()
    end
    return shed_answer(req, o, now, waited)
end

-- Access step: nil to continue, or a 429 error table. A request admitted in a pool with
-- known slots is charged to its tenant's fair-share counter
-- (infergate.admission.fairshare).
function _M.step_shed(req)
    local o = config.get().admission
    if not o.shed or (req.route ~= "inference" and req.route ~= "api") then
        return nil
    end
    local e = admit(req, o)
    if not e and req.slot_pool and fairshare.on(o) then
        fairshare.admitted(req, o)
    end
    return e
end

-- The last entry of an "$upstream_*" list ("502, 504 : 200" -> "200").
local function last_entry(v)
    if not v or v == "" then
        return nil
    end
    return v:match("([^%s,:]+)%s*$")
end

-- Log phase: a successful answer teaches the node's answer-time tail (routing.learned;
-- one its client left before the end, only that it took longer)
-- and its model's output length (routing.lengths; tokens: usage.completion_tokens).
local function learn_tail(req)
    local attempts = req.attempts
    local att = attempts and attempts[#attempts]
    local status = ngx.status
    -- a stream the edge relayed (infergate.stream.relay) closed its attempts itself and
    -- records the answer time of a stream that one node answered whole
    local relayed = req.relay and req.relay.latency_s
    local gone = status == 499 or status == 444 or (req.relay and req.relay.client_gone)
    if att and not att.closed and gone and att.started then
        learned.observe_cut(att.node, ngx_now() - att.started)   -- the client left first
        return
    end
    if not att or (att.closed and not relayed) or not status or status < 200 or status >= 300 then
        return
    end
    local rt = relayed or tonumber(last_entry(ngx_var("upstream_response_time")))
    if rt and rt > 0 then
        local tokens = usage.completion_tokens(req)
        learned.observe(att.node, rt, tokens)
        local m = learned.max_tokens(req)
        lengths.observe(req.model, tokens, nil, m ~= nil and tokens ~= nil and tokens >= m)
    end
end

-- Log phase hook: rate-limit correction from the real token usage, a slot held for a
-- try that never started given back, the answer time and slot frees learned (no I/O).
function _M.log(req)
    ratelimit.log(req)
    fairshare.log(req)
    held.give_back(req)
    learn_tail(req)
    freerate.log(req, ngx.status)
end

-- Counters for the edge stats and the status endpoint.
function _M.counters()
    return astats.all()
end

return _M
