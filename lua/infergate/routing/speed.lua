-- Learned concurrency: how many requests a node really runs at once, as this edge
-- observes it, so that a wrong max_concurrency (64 on a server that runs one request at
-- a time, such as llama-cpp-python) cannot herd requests onto one node.
--
-- Every successful attempt (2xx, with its upstream response time L, s) started with k
-- requests of this edge in flight on the node, itself included. Answers are kept per
-- level k (1..LEVELS_MAX): the mean of log L at that level (a running mean of its first
-- 1 / LEVEL_ALPHA answers, then an EWMA of LEVEL_ALPHA) and how many it has seen. A
-- node that runs c requests at once answers the k-th in about S x max(1, k / c) (S its
-- unqueued service time: beyond c a request waits for a slot, and slots free up c per
-- S), so the learned concurrency is the c in 1..(highest level seen) that fits the
-- level means best in log space (least squares, each level weighted by its answers up to
-- 1 / LEVEL_ALPHA, log S fitted with it; ties: the larger c, so levels that show no
-- queueing give the highest of them). Levels, not single answers, keep the estimate
-- unbiased when answer lengths vary (length does not depend on level), and L over its
-- length ratio (below), when known, takes that noise out. Each worker refits a node at
-- most every FIT_INTERVAL_S (s), and at once on a new level. s_min (the smallest L seen,
-- drifting up by MIN_DRIFT of the gap with every later answer taken alone on the node,
-- k = 1) is the fallback latency of predicted() below.
--
-- Guard rails (effective_of): the prior is the node's known slots, else its
-- max_concurrency, and also the ceiling; the floor is the most in flight seen to finish
-- far sooner than predicted (yield_to: the estimate rises to it at once); LEARNED_STALE_S
-- after the last answer it returns to the prior with a half-life of LEARNED_HALF_LIFE_S.
-- concurrency(node, has_score): the balancer's in-flight denominator: max_concurrency
-- with a fresh score, else min(max_concurrency, learned + 1, prior before a sample).
--
-- Service time: what one request of the mean answer length takes on the node when it
-- does not queue behind this edge's others (batching with them included): the EWMA
-- (SERVICE_ALPHA) over the successful attempts of L x min(1, B / k), B the learned
-- concurrency (an answer that started with no more in flight than the node runs at once
-- counts as it is, a later one with its predicted queueing taken out, so the estimate
-- warms up under any load), over the same EWMA of their length ratios (1 for an answer
-- of unknown tokens; infergate.routing.learned.length_ratio: which node got the long
-- answers is noise, not speed). It starts as the median of the first WARMUP answers
-- (not used before them); a later answer counts as at most CLIP times the estimate.
--
-- expected_s(node): the balancer's cost under edge.node_cost = "expected_delay", the
-- predicted completion time (s) of one more request on the node,
--     n = this edge's requests in flight on the node (none: others', routing.others)
--     B = learned concurrency, rounded (max_concurrency before the first sample)
--     expected = s x (1 + max(0, n + 1 - B) / B)
-- its own service time plus the work ahead of it, B requests at a time: shortest
-- expected delay among the nodes with room (infergate.routing.room) while any has, else
-- among all. Others' requests beside this edge's show in the service time instead.
--
-- An estimate that nothing refreshes ages: once a node has answered nothing for STALE_S
-- and has none of this edge's requests in flight, the service time used in expected_s
-- halves every HALF_LIFE_S more, so a node measured slow is tried again (one probe at a
-- time: the probe in flight stops the ageing, and its answer sets the estimate afresh).
--
-- Shared dict infergate_stats, as packed doubles (one read and one write per answer):
-- "sp:<node>" the node's record {time of the last answer (ngx.now(), s), s_min (s),
-- answers counted (up to WARMUP), service time (s), the first two of them (s), highest
-- level seen, learned concurrency, floor, mean log(answer / prediction), mean length
-- ratio}, a field not yet known stored as -1;
-- "lv:<node>:<k>" {mean log L (L in s) at level k, its answers (up to 1 / LEVEL_ALPHA)}.
-- Workers update a record by read and write, so two answers at the same instant in two
-- workers may count as one: the estimates are averages and lose nothing by it.
-- No I/O: safe in the balancer and log phases.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local prefixer = require("infergate.core.memo").prefixer
local ngx_now = ngxapi.now
local stats = require("infergate.routing.stats")
local snapshot = require("infergate.routing.snapshot")
local learned = require("infergate.routing.learned")
local others = require("infergate.routing.others")

local _M = {}

local shared = ngx.shared
local floor = math.floor
local log = math.log

_M.MIN_DRIFT = 0.02
_M.LEVEL_ALPHA = 0.05
_M.LEVELS_MAX = 128
_M.FIT_INTERVAL_S = 0.2
_M.SERVICE_ALPHA = 0.1
_M.WARMUP = 3
_M.CLIP = 4
_M.STALE_S = 5
_M.HALF_LIFE_S = 5
_M.LEARNED_HALF_LIFE_S = 60
_M.LEARNED_STALE_S = 30
_M.YIELD_ALPHA = 0.1
_M.YIELD_RATIO = 0.4

local yield_to
local last_fit = {}     -- worker-local: node -> ngx_now() of this worker's last fit

local function dict()
    return shared[config.DICT_STATS]
end

-- The packed records (see the top of this file). WARMUP is at most 3: the record holds
-- the first two answers.
local ffi = require("ffi")
local cdouble_p = ffi.typeof("const double *")
local F_SA, F_SM, F_SN, F_SV, F_S1, F_LM, F_LC = 0, 1, 2, 3, 4, 6, 7  -- 5: the second early answer
local F_FL, F_MR, F_LR = 8, 9, 10
local REC_BYTES, LVL_BYTES = 11 * 8, 2 * 8
local NONE = -1
local rec = ffi.new("double[11]")
local lvl = ffi.new("double[2]")
local rec_key = prefixer("sp:")
local lvl_keys = {}

local function lvl_key(name, k)
    local t = lvl_keys[name]
    if not t then
        t = {}
        lvl_keys[name] = t
    end
    local key = t[k]
    if not key then
        key = "lv:" .. name .. ":" .. k
        t[k] = key
    end
    return key
end

-- Node `name`'s record as stored (read it once, then take fields with value), or nil.
local function record(d, name)
    local raw = d:get(rec_key(name))
    if type(raw) ~= "string" or #raw ~= REC_BYTES then
        return nil
    end
    return raw
end

-- Field i of a record, or nil (no record, or the field not known yet).
local function value(raw, i)
    if not raw then
        return nil
    end
    local v = ffi.cast(cdouble_p, raw)[i]
    if v == NONE then
        return nil
    end
    return v
end

local function field(d, name, i)
    return value(record(d, name), i)
end

-- The level record of `name` at k: mean log L, answers; or nil.
local function level(d, name, k)
    local raw = d:get(lvl_key(name, k))
    if type(raw) ~= "string" or #raw ~= LVL_BYTES then
        return nil
    end
    local p = ffi.cast(cdouble_p, raw)
    return p[0], p[1]
end

-- The c of the top of this file from the level means of node `name` (levels 1..kmax);
-- nil when no level has an answer. For each c the fitted log S is the weighted mean of
-- the residuals r = y - log(max(1, k / c)) and the error is sum w r^2 - (sum w r)^2 /
-- sum w: one pass per c.
local function fit(d, name, kmax)
    local lks, ys, ws, m, top = {}, {}, {}, 0, 0
    local wmax = 1 / _M.LEVEL_ALPHA
    for k = 1, kmax do
        local y, n = level(d, name, k)
        if y then
            m = m + 1
            lks[m], ys[m], ws[m], top = log(k), y, (n < wmax and n or wmax), k
        end
    end
    if m == 0 then
        return nil
    end
    local best_c, best_err
    for c = 1, top do
        local lc = log(c)
        local sw, sr, srr = 0, 0, 0
        for i = 1, m do
            local q = lks[i] - lc
            local r = ys[i] - (q > 0 and q or 0)
            local w = ws[i]
            sw, sr, srr = sw + w, sr + w * r, srr + w * r * r
        end
        local err = srr - sr * sr / sw
        if not best_err or err <= best_err + 1e-9 then
            best_c, best_err = c, err
        end
    end
    return best_c
end

-- Balancer phase, after stats.open_attempt: in-flight on the node, this one included.
function _M.track(att)
    att.k = stats.inflight(att.node)
end

-- Loads node `name`'s record (dict key `key`) into rec; a fresh one when it has none.
local function load_rec(d, key)
    local raw = d:get(key)
    if type(raw) == "string" and #raw == REC_BYTES then
        ffi.copy(rec, raw, REC_BYTES)
    else
        for i = 0, 10 do
            rec[i] = NONE
        end
        rec[F_SN], rec[F_LM] = 0, 0
    end
end

-- Moves the mean log latency of level k (in-flight) of node `name` towards lat (s).
local function learn_level(d, name, k, lat)
    local y, n = level(d, name, k)
    n = (n or 0) + 1
    local alpha = 1 / n < _M.LEVEL_ALPHA and _M.LEVEL_ALPHA or 1 / n
    lvl[0] = y and (y + alpha * (log(lat) - y)) or log(lat)
    lvl[1] = n < 1 / _M.LEVEL_ALPHA and n or 1 / _M.LEVEL_ALPHA
    d:set(lvl_key(name, k), ffi.string(lvl, LVL_BYTES))
end

-- The learned concurrency of node `name` in rec after an answer at level k: refitted
-- on a new highest level or once FIT_INTERVAL_S passed, at most maxc.
local function learn_concurrency(d, name, k, maxc, now)
    local kmax = rec[F_LM]
    local lc = rec[F_LC]
    if lc == NONE then
        lc = nil
    end
    if k > kmax then
        kmax = k
        rec[F_LM] = kmax
        lc = nil                                      -- a new level: refit now
    end
    if not lc or now - (last_fit[name] or 0) >= _M.FIT_INTERVAL_S then
        last_fit[name] = now
        lc = fit(d, name, kmax)
        local fl = rec[F_FL]
        if fl ~= NONE and lc < fl then
            lc = fl
        end
        if lc > maxc then
            lc = maxc
        end
        rec[F_LC] = lc
    end
    return lc
end

-- The service time in rec after an answer `one` (s, its queueing taken out) of length
-- ratio `lr` (nil: 1): the median of the first WARMUP answers, then a clipped EWMA.
local function learn_service(one, lr)
    local sn = rec[F_SN]
    if sn >= _M.WARMUP then
        local sv = rec[F_SV] ~= NONE and rec[F_SV] or one
        local cap = _M.CLIP * sv
        if one > cap then -- clipped, a known length ratio with it: the two stay a pair
            one, lr = cap, lr and lr * cap / one
        end
        rec[F_SV] = sv + _M.SERVICE_ALPHA * (one - sv)
    elseif sn == _M.WARMUP - 1 then
        -- the estimate starts at the median of the first WARMUP answers
        local first = { one }
        for i = 1, _M.WARMUP - 1 do
            local v = rec[F_S1 + i - 1]
            first[#first + 1] = v ~= NONE and v or one
        end
        table.sort(first)
        rec[F_SV] = first[floor(#first / 2) + 1]
        rec[F_SN] = sn + 1
    else
        rec[F_S1 + sn] = one
        rec[F_SN] = sn + 1
    end
    local lm, r = rec[F_LR], lr or 1
    rec[F_LR] = lm == NONE and r or lm + _M.SERVICE_ALPHA * (r - lm)
end

-- Guard rail: an answer at level k > b was predicted to take S x k / b (S: the mean
-- answer alone, level 1, else the service time). When the EWMA (YIELD_ALPHA) of log(L /
-- that) falls below log(YIELD_RATIO), the floor (rec[F_FL]) and the learned concurrency
-- rise to k (at most maxc) at once.
function yield_to(d, name, k, b, lat, maxc)
    local base = level(d, name, 1)
    if not base and rec[F_SV] ~= NONE then
        base = log(rec[F_SV])
    end
    if k <= b or not base then
        return
    end
    local mr = rec[F_MR] == NONE and 0 or rec[F_MR]
    mr = mr + _M.YIELD_ALPHA * (log(lat * b / k) - base - mr)
    if mr < log(_M.YIELD_RATIO) then
        mr = 0
        k = k > maxc and maxc or k
        if rec[F_FL] == NONE or rec[F_FL] < k then
            rec[F_FL] = k
        end
        if rec[F_LC] < k then
            rec[F_LC] = k
        end
    end
    rec[F_MR] = mr
end

-- Log phase: a finished attempt. latency_ms: upstream response time of a 2xx answer
-- (nil otherwise: nothing learned); tokens: its completion tokens (nil: not known).
function _M.observe(att, latency_ms, tokens)
    if not latency_ms or latency_ms <= 0 or not att.k then
        return
    end
    local node = snapshot.current().by_name[att.node]
    local maxc = node and (node.slots or node.max_concurrency) or 64
    local d = dict()
    local name = att.node
    local lat = latency_ms / 1000
    local now = ngx_now()
    local key = rec_key(name)
    load_rec(d, key)
    rec[F_SA] = now
    local smin = rec[F_SM]
    if smin == NONE or lat < smin then
        smin = lat
    elseif att.k <= 1 then
        smin = smin + _M.MIN_DRIFT * (lat - smin)  -- alone on the node: no queueing in lat
    end
    rec[F_SM] = smin
    local k = att.k
    if k > _M.LEVELS_MAX then
        k = _M.LEVELS_MAX
    end
    local lr = learned.length_ratio(name, tokens)
    local ln = lr and lat / lr or lat   -- as if of the mean length
    learn_level(d, name, k, ln)
    local b = _M.round_concurrency(learn_concurrency(d, name, k, maxc, now))
    yield_to(d, name, k, b, ln, maxc)
    b = _M.round_concurrency(rec[F_LC])
    local one = att.k > b and lat * b / att.k or lat   -- its predicted queueing taken out
    learn_service(one, lr)
    d:set(key, ffi.string(rec, REC_BYTES))
end

-- Test hook: sets the time of node `name`'s last answer (s) in its record.
function _M._set_last_answer(name, t)
    local d = dict()
    if record(d, name) then
        load_rec(d, rec_key(name))
        rec[F_SA] = t
        d:set(rec_key(name), ffi.string(rec, REC_BYTES))
    end
end

-- A learned concurrency as a whole number of requests (at least 1).
function _M.round_concurrency(lc)
    local b = floor(lc + 0.5)
    return b < 1 and 1 or b
end

-- Whether an attempt started queued behind this edge's own requests on its node (more in
-- flight there than the node runs at once); false while nothing is learned.
function _M.queued(att)
    local lc = att.k and field(dict(), att.node, F_LC)
    return lc ~= nil and att.k > _M.round_concurrency(lc)
end

-- The prior of a node's concurrency: its known slots, else its max_concurrency.
local function prior_of(node)
    return node.slots or node.max_concurrency or 1
end

-- The learned concurrency of `node` with its guard rails (top of this file), or nil
-- before the first sample.
local function effective_of(raw, node, now)
    local lc = value(raw, F_LC)
    if not lc then
        return nil
    end
    local prior = prior_of(node)
    local fl = value(raw, F_FL)
    if fl and lc < fl then
        lc = fl
    end
    local at = value(raw, F_SA)
    local idle = at and (now or ngx_now()) - at
    if idle and idle > _M.LEARNED_STALE_S then
        lc = prior + (lc - prior) * 0.5 ^ ((idle - _M.LEARNED_STALE_S) / _M.LEARNED_HALF_LIFE_S)
    end
    if lc > prior then
        return prior
    end
    return lc < 1 and 1 or lc
end

-- B of the formula above: the learned concurrency of `node` (with its guard rails),
-- rounded, or its prior before the first sample.
local function batch_of(raw, node)
    local lc = effective_of(raw, node)
    return lc and _M.round_concurrency(lc) or prior_of(node)
end

function _M.batch(node)
    return batch_of(record(dict(), node.name), node)
end

-- Service time (s) of node `name`, or nil before its first WARMUP unqueued answers.
local function service_of(raw)
    if (value(raw, F_SN) or 0) < _M.WARMUP then
        return nil
    end
    return value(raw, F_SV) / (value(raw, F_LR) or 1)
end

function _M.service_s(name)
    return service_of(record(dict(), name))
end

-- The service time (s) expected_s uses: service_s aged by the time since the node's last
-- answer (see the top of this file), or nil before its first WARMUP unqueued answers.
-- `inflight`: this edge's requests in flight on the node, when the caller has it.
local function aged_of(raw, name, now, inflight)
    local s = service_of(raw)
    if not s then
        return nil
    end
    local at = value(raw, F_SA)
    local idle = at and (now or ngx_now()) - at - _M.STALE_S
    if idle and idle > 0 and (inflight or stats.inflight(name)) == 0 then
        return s * 0.5 ^ (idle / _M.HALF_LIFE_S)
    end
    return s
end

function _M.aged_service_s(name, now, inflight)
    return aged_of(record(dict(), name), name, now, inflight)
end

-- Predicted completion (s) of one more request on `node` (see the top of this file), or
-- nil while the node has no service time.
function _M.expected_s(node)
    local n = stats.inflight(node.name)
    local raw = record(dict(), node.name)   -- one read for all of the node's figures
    local s = aged_of(raw, node.name, nil, n)
    if not s then
        return nil
    end
    local b = batch_of(raw, node)
    local ahead = (n > 0 and n or others.count(node, ngx_now(), 0)) + 1 - b
    if ahead > 0 then
        return s * (1 + ahead / b)
    end
    return s
end

-- Learned concurrency of node `name` (nil before its first sample).
function _M.learned(name)
    return field(dict(), name, F_LC)
end

-- The learned concurrency of `node` with its guard rails (nil before its first sample).
function _M.effective(node, now)
    return effective_of(record(dict(), node.name), node, now)
end

function _M.concurrency(node, has_score)
    local maxc = node.max_concurrency
    if has_score then
        return maxc
    end
    local lc = effective_of(record(dict(), node.name), node)
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
    local s = lat and lat / 1000 or field(dict(), name, F_SM)
    if not s or s <= 0 then
        return nil
    end
    local c = _M.concurrency(node, has_score)
    local ahead = stats.inflight(name) + 1 - c
    local wait = ahead > 0 and ahead / c * s or 0
    return wait + s, wait
end

return _M
