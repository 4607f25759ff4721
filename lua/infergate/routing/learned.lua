-- The tail of a node's answer times, learned with guard rails: what admission control
-- predicts a request will take (infergate.admission.slots), so that a queue is let grow
-- only while a long answer, not the mean one, still meets its deadline.
--
-- Per node, from every successful answer (its upstream time L, s; the log phase):
--   q   the QUANTILE (0.9) of L: a stochastic quantile estimate, moved by STEP x q up
--       (times QUANTILE) when L > q and down (times 1 - QUANTILE) otherwise
--   pt  time per output token (s): an EWMA (PT_ALPHA) of L / completion_tokens, when the
--       answer said its usage
-- Guard rails, given the node's mean m (its latency EWMA, s): the prior of q is
-- PRIOR x m (before the first answer, and what q decays back to with a half-life of
-- HALF_LIFE_S while no answer comes); q is kept within [m, CEILING x m]. A request with
-- max_tokens (or max_completion_tokens) takes at most pt x that many tokens.
--
-- Shared dict infergate_stats, "tq:<node>": packed doubles {q, time of the last answer
-- (ngx.now(), s), pt or -1}. No I/O: safe in every phase.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local ffi = require("ffi")

local _M = {}

_M.QUANTILE = 0.9
_M.STEP = 0.05
_M.PRIOR = 2
_M.CEILING = 8
_M.HALF_LIFE_S = 60
_M.PT_ALPHA = 0.1

local shared = ngx.shared
local ngx_now = ngxapi.now
local cdouble_p = ffi.typeof("const double *")
local BYTES = 3 * 8
local buf = ffi.new("double[3]")
local type = type

local function dict()
    return shared[config.DICT_STATS]
end

-- q, time of the last answer, pt (nil when unknown) of node `name`; nil without a record.
local function read(name)
    local raw = dict():get("tq:" .. name)
    if type(raw) ~= "string" or #raw ~= BYTES then
        return nil
    end
    local p = ffi.cast(cdouble_p, raw)
    local pt = p[2]
    return p[0], p[1], pt >= 0 and pt or nil
end

-- A successful answer of node `name` after lat_s seconds; tokens: its completion tokens
-- (nil: not known).
function _M.observe(name, lat_s, tokens, now)
    if not lat_s or lat_s <= 0 then
        return
    end
    local q, _, pt = read(name)
    if not q then
        q = lat_s
    elseif lat_s > q then
        q = q + _M.STEP * q * _M.QUANTILE
    else
        q = q - _M.STEP * q * (1 - _M.QUANTILE)
    end
    if tokens and tokens > 0 then
        local one = lat_s / tokens
        pt = pt and (pt + _M.PT_ALPHA * (one - pt)) or one
    end
    buf[0], buf[1], buf[2] = q, now or ngx_now(), pt or -1
    dict():set("tq:" .. name, ffi.string(buf, BYTES))
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
    local prior = _M.PRIOR * mean_s
    local q, at, pt = read(name)
    if not q then
        q = prior
    else
        local idle = (now or ngx_now()) - at
        if idle > 0 then
            q = prior + (q - prior) * 0.5 ^ (idle / _M.HALF_LIFE_S)
        end
    end
    if q < mean_s then
        q = mean_s
    elseif q > _M.CEILING * mean_s then
        q = _M.CEILING * mean_s
    end
    local m = pt and max_tokens(req)
    if m and pt * m < q then
        q = pt * m
    end
    return q
end

-- {q (s), pt (s) or nil} of node `name` as stored (status, tests), or nil.
function _M.info(name)
    local q, at, pt = read(name)
    if not q then
        return nil
    end
    return { q = q, at = at, pt = pt }
end

return _M
