-- The tail of a node's answer times, learned with guard rails: what admission control
-- predicts a request will take (infergate.admission.slots), so that a queue is let grow
-- only while a long answer, not the mean one, still meets its deadline.
--
-- Per node, from every successful answer (its upstream time L, s; the log phase):
--   m   the mean of L: an EWMA (MEAN_ALPHA, as the node's latency EWMA,
--       infergate.routing.stats)
--   e   the QUANTILE (0.9) of L - m (m before the answer: how far a long answer runs
--       past the mean), a stochastic quantile estimate moved by STEP x m up (times
--       QUANTILE) when L - m > e and down (times 1 - QUANTILE) otherwise. The tail is
--       the node's mean now plus e: a queue growing at the node adds to every answer's
--       time, which the mean carries at once, while the spread of the answers (their
--       lengths) stays. A quantile of the times themselves, moved a few percent per
--       answer, trails a growing queue by dozens of answers, below the mean meanwhile.
--   pt  time per output token (s): an EWMA (PT_ALPHA) of L / completion_tokens, when the
--       answer's tokens are known (its usage, or a stream's counted content chunks)
-- An answer its client left unfinished after T s (observe_cut) would have taken longer:
-- T - m past e moves e up as a longer answer does; before it, it says nothing. Without
-- it the tail would learn only from the answers clients waited for.
-- Guard rails, given the node's mean m (the caller's: its latency EWMA, s): the prior of
-- the tail is PRIOR x m (e = (PRIOR - 1) x m before the first answer, and what e decays
-- back to with a half-life of HALF_LIFE_S while no answer comes); the tail is kept
-- within [m, CEILING x m]. Requests finishing far sooner than predicted bring the mean
-- down, and the tail with it; when the node sped up (its answers' spread shrank with
-- them), YIELD_RUN answers in a row shorter than the tail / YIELD_FACTOR set the tail to
-- the largest of them at once (infergate.routing.guard.yield).
-- Answer time against length: a least-squares line L = a + b x T over the answers
-- that said their completion tokens T (EWMAs, FIT_ALPHA, of T, L, T^2 and T x L; b >= 0,
-- a >= 0, else L proportional to T). When the request's model has an output-length
-- quantile (infergate.routing.lengths: n tokens, or the request's max_tokens when
-- fewer) and a + b x n is below the tail, the request's own time moves from the tail
-- toward it (not below m) by the weight of that quantile (1 while fresh, decaying to 0:
-- back to the tail):
-- what the model's answers are known to need can only make the prediction yield, never
-- shed more than the node's own tail does. A request with max_tokens (or
-- max_completion_tokens) takes at most pt x that many tokens.
--
-- Length ratio (length_ratio): what an answer of T tokens takes on the node against
-- one of the edge's mean answer length Tm (an EWMA, FIT_ALPHA, of every answer's T,
-- all nodes together), by the node's own line: (a + b x T) / (a + b x Tm), within
-- [1 / RATIO_MAX, RATIO_MAX]; none while either is unknown. The answer times of equal
-- nodes over their ratios match whichever got the long answers
-- (infergate.routing.speed); a node slower at every length stays slower, as its a and
-- b both grow.
--
-- Shared dict infergate_stats, "tq:<node>": packed doubles {e (s), time of the last
-- answer (ngx.now(), s), pt or -1, run, largest of the run, E[T] or -1, E[L], E[T^2],
-- E[T x L], m};
-- "tq*": Tm, a number. No I/O: safe in every phase.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local guard = require("infergate.routing.guard")
local lengths = require("infergate.routing.lengths")
local ffi = require("ffi")

local _M = {}

_M.QUANTILE = 0.9
_M.STEP = 0.05
_M.PRIOR = 2
_M.CEILING = 8
_M.HALF_LIFE_S = 60
_M.PT_ALPHA = 0.1
_M.FIT_ALPHA = 0.05
_M.RATIO_MAX = 16
_M.YIELD_FACTOR = 4
_M.YIELD_RUN = 8
_M.MEAN_ALPHA = 0.3

local shared = ngx.shared
local ngx_now = ngxapi.now
local cdouble_p = ffi.typeof("const double *")
local FIELDS = 10
local BYTES = FIELDS * 8
local buf = ffi.new("double[10]")
local type = type
local TM_KEY = "tq*"

local function dict()
    return shared[config.DICT_STATS]
end

-- The packed record of node `name` (a pointer to FIELDS doubles), or nil.
local function record(name)
    local raw = dict():get("tq:" .. name)
    if type(raw) ~= "string" or #raw ~= BYTES then
        return nil
    end
    return ffi.cast(cdouble_p, raw)
end

-- The edge's mean answer length Tm (tokens), or nil before the first answer with one.
local function mean_tokens(d)
    local tm = d:get(TM_KEY)
    return type(tm) == "number" and tm or nil
end

-- e, time of the last answer, pt (nil when unknown) of node `name`, and the record; nil
-- without a record.
local function read(name)
    local p = record(name)
    if not p then
        return nil
    end
    local pt = p[2]
    return p[0], p[1], pt >= 0 and pt or nil, p
end

-- The fitted answer time (s) at n tokens from record p, or nil before any length.
local function time_at(p, n)
    local mt, ml = p[5], p[6]
    if mt <= 0 then
        return nil
    end
    local var = p[7] - mt * mt
    local b = var > 1e-9 and (p[8] - mt * ml) / var or -1
    local a = b >= 0 and ml - b * mt or -1
    if a < 0 then
        a, b = 0, ml / mt
    end
    return a + b * n
end
_M._time_at = time_at

-- e moved by an answer x s past the mean m (see the top of this file), within
-- [0, (CEILING - 1) x m].
local function excess_after(e, x, m)
    if x > e then
        e = e + _M.STEP * m * _M.QUANTILE
    else
        e = e - _M.STEP * m * (1 - _M.QUANTILE)
    end
    return guard.clamp(e, 0, (_M.CEILING - 1) * m)
end

-- A successful answer of node `name` after lat_s seconds; tokens: its completion tokens
-- (nil: not known).
function _M.observe(name, lat_s, tokens, now)
    if not lat_s or lat_s <= 0 then
        return
    end
    local e, _, pt, p = read(name)
    local mt, ml, mtt, mtl, m = -1, 0, 0, 0, lat_s
    if p then
        mt, ml, mtt, mtl, m = p[5], p[6], p[7], p[8], p[9]
    end
    local run, run_max, m_after = 0, 0, m + _M.MEAN_ALPHA * (lat_s - m)
    if not e then
        e = (_M.PRIOR - 1) * lat_s
    else
        local tail = m + e
        e = excess_after(e, lat_s - m, m)
        local yielded
        yielded, run, run_max = guard.yield(tail, lat_s, p[3], p[4], _M.YIELD_FACTOR,
                                            _M.YIELD_RUN)
        if yielded ~= tail then   -- a run far sooner than the tail: it is where they are
            e = math.max(0, yielded - m_after)
        end
    end
    if tokens and tokens > 0 then
        local one = lat_s / tokens
        pt = pt and (pt + _M.PT_ALPHA * (one - pt)) or one
        if mt <= 0 then
            mt, ml, mtt, mtl = tokens, lat_s, tokens * tokens, tokens * lat_s
        else
            local a = _M.FIT_ALPHA
            mt = mt + a * (tokens - mt)
            ml = ml + a * (lat_s - ml)
            mtt = mtt + a * (tokens * tokens - mtt)
            mtl = mtl + a * (tokens * lat_s - mtl)
        end
    end
    buf[0], buf[1], buf[2], buf[3], buf[4] = e, now or ngx_now(), pt or -1, run, run_max
    buf[5], buf[6], buf[7], buf[8] = mt, ml, mtt, mtl
    buf[9] = m_after
    local d = dict()
    d:set("tq:" .. name, ffi.string(buf, BYTES))
    if tokens and tokens > 0 then
        local tm = mean_tokens(d)
        d:set(TM_KEY, tm and tm + _M.FIT_ALPHA * (tokens - tm) or tokens)
    end
end

-- The length ratio (see the top of this file) of an answer of `tokens` completion tokens
-- on node `name`; nil when tokens, the node's line or the mean length is not known.
function _M.length_ratio(name, tokens)
    if not tokens or tokens <= 0 then
        return nil
    end
    local tm = mean_tokens(dict())
    local p = tm and record(name)
    local at_m = p and time_at(p, tm)
    if not at_m or at_m <= 0 then
        return nil
    end
    return guard.clamp(time_at(p, tokens) / at_m, 1 / _M.RATIO_MAX, _M.RATIO_MAX)
end

-- The max_tokens of the request's body (max_completion_tokens first), or nil.
local function max_tokens(req)
    local body = req and req.body
    if type(body) ~= "table" then
        return nil
    end
    local m = body.max_completion_tokens
    if type(m) ~= "number" then
        m = body.max_tokens
    end
    if type(m) == "number" and m > 0 then
        return m
    end
    return nil
end
_M.max_tokens = max_tokens

-- The predicted time (s) of a request `req` on node `name` whose mean is mean_s: the
-- high quantile with its guard rails (see the top of this file).
function _M.tail_s(name, mean_s, req, now)
    now = now or ngx_now()
    local e, at, pt, p = read(name)
    local prior = (_M.PRIOR - 1) * mean_s
    if e then
        e = guard.decay(e, prior, now - at, 0, _M.HALF_LIFE_S)
    end
    local q = guard.clamp(mean_s + (e or prior), mean_s, _M.CEILING * mean_s)
    local m = pt and max_tokens(req)
    if pt then
        local n, w = lengths.quantile(req and req.model, now)
        if n and w > 0 then
            if m and m < n then
                n = m
            end
            local t = time_at(p, n)
            if t and t < q then
                q = q + w * ((t > mean_s and t or mean_s) - q)
            end
        end
    end
    if m and pt * m < q then
        q = pt * m
    end
    return q
end

-- How long the answer of `req`, a request that is not a stream, may take on node `name`
-- (s): OWN_FACTOR x the node's fitted answer time (or pt x tokens) at the request's
-- max_tokens, or without it at its model's output-length quantile (infergate.routing.
-- lengths) while that has weight; nil while the node or the length is unknown. Its first
-- byte comes with its whole answer: infergate.routing.outlier does not take a node for
-- hung before a request asked for many tokens had this long.
_M.OWN_FACTOR = 2

-- The node's fitted answer time (s) at the request's max_tokens (or its model's length
-- quantile, as above), without the factor; nil while unknown.
function _M.answer_s(name, req, now)
    local _, _, pt, p = read(name)
    if not p then
        return nil
    end
    local n = max_tokens(req)
    if not n then
        local q, w = lengths.quantile(req and req.model, now)
        if not q or w <= 0 then
            return nil
        end
        n = q
    end
    return time_at(p, n) or (pt and pt * n)
end

function _M.answer_bound_s(name, req, now)
    local t = _M.answer_s(name, req, now)
    return t and _M.OWN_FACTOR * t or nil
end

-- An answer of node `name` cut after lat_s seconds, unfinished (its client left): see
-- the top of this file.
function _M.observe_cut(name, lat_s, now)
    local p = record(name)
    if not p or not lat_s or lat_s - p[9] <= p[0] then
        return
    end
    for i = 0, FIELDS - 1 do
        buf[i] = p[i]
    end
    buf[0] = excess_after(p[0], lat_s - p[9], p[9])
    buf[1], buf[3], buf[4] = now or ngx_now(), 0, 0   -- a run of far shorter ones ends
    dict():set("tq:" .. name, ffi.string(buf, BYTES))
end

-- {e (s), at, pt (s) or nil, m (s)} of node `name` as stored (status, tests), or nil.
function _M.info(name)
    local e, at, pt, p = read(name)
    if not e then
        return nil
    end
    return { e = e, at = at, pt = pt, m = p[9] }
end

return _M
