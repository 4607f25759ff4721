-- The output length of a model's answers, learned with guard rails: a high quantile of
-- the completion tokens per model, which admission control (infergate.routing.learned
-- tail_s) turns into the request's own time at the tail when the request does not say
-- its max_tokens.
--
-- Per model (the request's "model", "" when it names none), from every successful
-- answer that says or shows its completion tokens T (its usage, or its content chunks
-- counted for a stream: infergate.admission.usage):
--   q  the QUANTILE (0.9) of T: a stochastic quantile estimate, moved by STEP x q up
--      (times QUANTILE) when T > q and down (times 1 - QUANTILE) otherwise; the first
--      answer sets it
-- An answer cut by its request's max_tokens (T >= max_tokens) says only that the model
-- would have written T tokens or more: it may raise q (as above when T > q), never
-- lower it or count in a run below, and it starts no record. A client that asks for 1
-- token (a classifier, a probe) would otherwise teach the model's answers to be 1 token
-- long, and the queue would admit long answers it cannot finish in time.
-- Guard rails: q stays within [1, the largest T seen]; YIELD_RUN answers in a row
-- shorter than q / YIELD_FACTOR set it to the largest of them at once
-- (infergate.routing.guard.yield); weight(): how much q still counts against the prior
-- (the node's answer-time tail, which knows no length): 1 until STALE_S after the last
-- answer, then halving every HALF_LIFE_S. No record: weight 0.
--
-- Shared dict infergate_stats, "oq:<model>" (not "ol:", the outlier flags of nodes,
-- which may share a model's name): packed doubles {q, time of the last answer
-- (ngx.now(), s), run, largest of the run, largest T seen}. No I/O: safe in every phase.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local guard = require("infergate.routing.guard")
local ffi = require("ffi")

local _M = {}

_M.QUANTILE = 0.9
_M.STEP = 0.05
_M.YIELD_FACTOR = 4
_M.YIELD_RUN = 8
_M.STALE_S = 60
_M.HALF_LIFE_S = 120

local shared = ngx.shared
local ngx_now = ngxapi.now
local cdouble_p = ffi.typeof("const double *")
local FIELDS = 5
local BYTES = FIELDS * 8
local buf = ffi.new("double[5]")
local type = type

local function key(model)
    return "oq:" .. (type(model) == "string" and model or "")
end

local function read(model)
    local raw = shared[config.DICT_STATS]:get(key(model))
    if type(raw) ~= "string" or #raw ~= BYTES then
        return nil
    end
    local p = ffi.cast(cdouble_p, raw)
    return p[0], p[1], p[2], p[3], p[4]
end

-- A successful answer of `model` with `tokens` completion tokens; `capped`: it was cut
-- by the request's max_tokens (a lower bound, see the top of this file).
function _M.observe(model, tokens, now, capped)
    if type(tokens) ~= "number" or tokens < 1 then
        return
    end
    local q, _, run, run_max, top = read(model)
    if capped then
        if not q or tokens <= q then
            return
        end
        q = q + _M.STEP * q * _M.QUANTILE
        if tokens > top then
            top = tokens
        end
        q = guard.clamp(q, 1, top)
    elseif not q then
        q, run, run_max, top = tokens, 0, 0, tokens
    else
        if tokens > q then
            q = q + _M.STEP * q * _M.QUANTILE
        else
            q = q - _M.STEP * q * (1 - _M.QUANTILE)
        end
        if tokens > top then
            top = tokens
        end
        q, run, run_max = guard.yield(q, tokens, run, run_max, _M.YIELD_FACTOR, _M.YIELD_RUN)
        q = guard.clamp(q, 1, top)
    end
    buf[0], buf[1], buf[2], buf[3], buf[4] = q, now or ngx_now(), run, run_max, top
    shared[config.DICT_STATS]:set(key(model), ffi.string(buf, BYTES))
end

-- The learned quantile (tokens) of `model` and its weight against the prior (0..1), or
-- nil, 0 without a record.
function _M.quantile(model, now)
    local q, at = read(model)
    if not q then
        return nil, 0
    end
    return q, guard.weight((now or ngx_now()) - at, _M.STALE_S, _M.HALF_LIFE_S)
end

-- {q, at, run, top} of `model` as stored (status, tests), or nil.
function _M.info(model)
    local q, at, run, _, top = read(model)
    if not q then
        return nil
    end
    return { q = q, at = at, run = run, top = top }
end

return _M
