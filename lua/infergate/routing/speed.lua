-- Learned concurrency: how many requests a node really runs at once, as this edge
-- observes it, so that a wrong max_concurrency (64 on a server that runs one request at
-- a time, such as llama-cpp-python) cannot herd requests onto one node.
--
-- Every successful attempt (2xx, with its upstream response time L, s) started with k
-- requests of this edge in flight on the node, itself included. With s_min the node's
-- shortest recent latency (the time of a request that did not queue), a node that runs
-- c requests at once answers the k-th in about ceil(k / c) x s_min, so
--     sample = clamp(k x s_min / L, 1, max_concurrency)
-- is an estimate of c (at k <= c it is k: a lower bound that rises with the load). The
-- learned concurrency is the EWMA (ALPHA) of the samples. s_min is the smallest L seen,
-- drifting up by MIN_DRIFT of the gap with every later sample taken alone on the node
-- (k = 1, no queueing in it), so a node that became slower for good is followed.
--
-- concurrency(node, has_score): the denominator of the balancer's in-flight term. Nodes
-- with a fresh score (the control plane reads their queue and KV cache) keep
-- max_concurrency; the others get min(max_concurrency, learned + 1) -- one more than
-- learned, so the estimate can grow when the node is faster than thought -- and
-- max_concurrency before their first sample.
--
-- Service time: the EWMA (SERVICE_ALPHA) of L over the successful attempts that started
-- with no more of this edge's requests in flight on the node than it runs at once
-- (k <= the learned concurrency, rounded): what one request takes there when it does
-- not queue behind this edge's others, batching with them included. It starts as the
-- median of the first WARMUP such answers (and is not used before them), and a later
-- answer counts as at most CLIP times the estimate, so one long answer (a 250-token
-- stream among short questions) cannot make a node look slow for minutes.
--
-- expected_s(node): the balancer's cost under edge.node_cost = "expected_delay", the
-- predicted completion time (s) of one more request on the node,
--     n = this edge's requests in flight on the node
--     B = learned concurrency, rounded (max_concurrency before the first sample)
--     expected = s x (1 + max(0, n + 1 - B) / B)
-- its own service time plus the work ahead of it, B requests at a time: shortest
-- expected delay, so a node three times slower gets a request only when the faster
-- ones have that much work queued. Other edges' requests are not in n; they show in the
-- service time, which grows when they make this edge's unqueued requests wait.
--
-- An estimate that nothing refreshes ages: once a node has answered nothing for
-- STALE_S and has none of this edge's requests in flight, the service time used in
-- expected_s halves every HALF_LIFE_S more, so a node measured slow (a few long answers,
-- or a slow spell that has passed) is tried again when the others are idle or busy
-- enough, instead of staying idle for good while the faster ones never queue. The
-- probe in flight stops the ageing (one probe at a time, not a burst onto a slow node)
-- and its answer sets the estimate afresh: a node that really is slow costs one request
-- per probe, a few per minute at a low load.
--
-- Shared dict infergate_stats: "sm:<node>" s_min (s), "lc:<node>" learned concurrency,
-- "sv:<node>" service time (s), "sn:<node>" unqueued answers counted (up to WARMUP),
-- "s1:<node>", "s2:<node>" the first of them (s), "sa:<node>" time of the last answer
-- (ngx.now(), s).
-- No I/O: safe in the balancer and log phases.
local config = require("infergate.core.config")
local stats = require("infergate.routing.stats")
local snapshot = require("infergate.routing.snapshot")

local _M = {}

local shared = ngx.shared
local floor = math.floor

_M.ALPHA = 0.2
_M.MIN_DRIFT = 0.02
_M.SERVICE_ALPHA = 0.1
_M.WARMUP = 3
_M.CLIP = 4
_M.STALE_S = 5
_M.HALF_LIFE_S = 5

local function dict()
    return shared[config.DICT_STATS]
end

-- Balancer phase, after stats.open_attempt: in-flight on the node, this one included.
function _M.track(att)
    att.k = stats.inflight(att.node)
end

-- Log phase: a finished attempt. latency_ms: upstream response time of a 2xx answer
-- (nil otherwise: nothing learned).
function _M.observe(att, latency_ms)
    if not latency_ms or latency_ms <= 0 or not att.k then
        return
    end
    local node = snapshot.current().by_name[att.node]
    local max_concurrency = node and node.max_concurrency
    local d = dict()
    local name = att.node
    local lat = latency_ms / 1000
    d:set("sa:" .. name, ngx.now())
    local smin = d:get("sm:" .. name)
    if not smin or lat < smin then
        smin = lat
    elseif att.k <= 1 then
        smin = smin + _M.MIN_DRIFT * (lat - smin)  -- alone on the node: no queueing in lat
    end
    d:set("sm:" .. name, smin)
    local sample = att.k * smin / lat
    if sample < 1 then
        sample = 1
    end
    local maxc = max_concurrency or 64
    if sample > maxc then
        sample = maxc
    end
    local old = d:get("lc:" .. name)
    local lc = old and (old + _M.ALPHA * (sample - old)) or sample
    d:set("lc:" .. name, lc)
    if att.k <= _M.round_concurrency(lc) then
        local n = d:get("sn:" .. name) or 0
        if n >= _M.WARMUP then
            local sv = d:get("sv:" .. name) or lat
            local cap = _M.CLIP * sv
            d:set("sv:" .. name, sv + _M.SERVICE_ALPHA * ((lat < cap and lat or cap) - sv))
        elseif n == _M.WARMUP - 1 then
            -- the estimate starts at the median of the first WARMUP answers
            local first = {lat}
            for i = 1, _M.WARMUP - 1 do
                first[#first + 1] = d:get("s" .. i .. ":" .. name) or lat
            end
            table.sort(first)
            d:set("sv:" .. name, first[floor(#first / 2) + 1])
            d:set("sn:" .. name, n + 1)
        else
            d:set("s" .. (n + 1) .. ":" .. name, lat)
            d:set("sn:" .. name, n + 1)
        end
    end
end

-- A learned concurrency as a whole number of requests (at least 1).
function _M.round_concurrency(lc)
    local b = floor(lc + 0.5)
    if b < 1 then
        return 1
    end
    return b
end

-- Whether an attempt started queued behind this edge's own requests on its node (more in
-- flight there than the node runs at once); false while nothing is learned.
function _M.queued(att)
    local lc = att.k and dict():get("lc:" .. att.node)
    return lc ~= nil and att.k > _M.round_concurrency(lc)
end

-- B of the formula above: the learned concurrency of `node`, rounded, or its
-- max_concurrency before the first sample.
function _M.batch(node)
    local lc = dict():get("lc:" .. node.name)
    return lc and _M.round_concurrency(lc) or (node.max_concurrency or 1)
end

-- Service time (s) of node `name`, or nil before its first WARMUP unqueued answers.
function _M.service_s(name)
    local d = dict()
    if (d:get("sn:" .. name) or 0) < _M.WARMUP then
        return nil
    end
    return d:get("sv:" .. name)
end

-- The service time (s) expected_s uses: service_s aged by the time since the node's last
-- answer (see the top of this file), or nil before its first WARMUP unqueued answers.
-- `inflight`: this edge's requests in flight on the node, when the caller has it.
function _M.aged_service_s(name, now, inflight)
    local s = _M.service_s(name)
    if not s then
        return nil
    end
    local at = dict():get("sa:" .. name)
    local idle = at and (now or ngx.now()) - at - _M.STALE_S
    if idle and idle > 0 and (inflight or stats.inflight(name)) == 0 then
        return s * 0.5 ^ (idle / _M.HALF_LIFE_S)
    end
    return s
end

-- Predicted completion (s) of one more request on `node` (see the top of this file), or
-- nil while the node has no service time.
function _M.expected_s(node)
    local n = stats.inflight(node.name)
    local s = _M.aged_service_s(node.name, nil, n)
    if not s then
        return nil
    end
    local b = _M.batch(node)
    local ahead = n + 1 - b
    if ahead > 0 then
        return s * (1 + ahead / b)
    end
    return s
end

-- Learned concurrency of node `name` (nil before its first sample).
function _M.learned(name)
    return dict():get("lc:" .. name)
end

function _M.concurrency(node, has_score)
    local maxc = node.max_concurrency
    if has_score then
        return maxc
    end
    local lc = dict():get("lc:" .. node.name)
    if not lc then
        return maxc
    end
    lc = lc + 1
    if lc < maxc then
        return lc
    end
    return maxc
end

-- Predicted completion (s) of one more request on `node` at this edge: the work ahead
-- of it, max(0, inflight + 1 - C) requests at C at a time, plus its own, each taking
-- s = the node's latency EWMA (what its requests take at the load it has had, queueing
-- included, so a node that is getting overloaded predicts longer and longer waits;
-- s_min while it has no EWMA):
--     wait = max(0, inflight + 1 - C) / C x s,   completion = wait + s
-- Returns completion, wait; nil when the node has no latency history yet.
function _M.predicted(node, has_score)
    local name = node.name
    local lat = stats.latency_ewma_ms(name)
    local s = lat and lat / 1000 or dict():get("sm:" .. name)
    if not s or s <= 0 then
        return nil
    end
    local c = _M.concurrency(node, has_score)
    local ahead = stats.inflight(name) + 1 - c
    local wait = ahead > 0 and ahead / c * s or 0
    return wait + s, wait
end

return _M
