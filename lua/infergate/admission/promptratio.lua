-- Learned prompt tokens per estimated prompt token, per API key and model: the up-front
-- estimate of the token buckets (infergate.admission.ratelimit) is characters /
-- limits.chars_per_token, which undercounts what the node bills for some prompts. Chinese
-- or Japanese text takes about a token per character (4x the estimate at 4 characters a
-- token), and a chat template adds its role and turn markers to every message. The
-- difference is settled after the answer (infergate.admission.settlement), but the
-- bucket looks fuller than it is until then: the next request passes, and the
-- Retry-After of a 429 is too short for the debt that follows.
--
-- The ratio: from every 2xx answer whose usage the node reported (not estimated,
-- infergate.admission.usage) with prompt_tokens, an EWMA (ALPHA) of the billed prompt
-- tokens and one of the raw estimates; ratio = the first / the second (a ratio of
-- sums, so long prompts, which weigh most in a tokens bucket, count most). Guard rails:
-- used once MIN_OBS answers are in; FLOOR 1 (never below the configured
-- chars_per_token, the rule it refines: a text that bills fewer tokens than
-- estimated is given back at settlement, as before); CEIL 8; forgotten TTL_S after
-- the last answer (back to the prior, the configured figure). Per key and model, so
-- one tenant's prompts never raise another's estimates (without a key: per model).
-- The ratio is applied (scale) to a prompt up to SPAN times the learned mean estimate;
-- the part of a longer prompt beyond that counts at 1, as before any answer: short
-- prompts bill mostly their chat template's fixed tokens (a 13-character message, 4
-- estimated, billed 27 by a gemma 3 llama-server), a ratio that does not grow with the
-- prompt. Three such messages had made a key's next 8,000-character prompt (2,000
-- estimated, 1,629 billed) cost 16,000, so a 6,000 tokens-a-minute key got a 429
-- (Retry-After 15 s) on its second such prompt with 3,300 tokens used.
--
-- Shared dict infergate_stats, "ptr:<key id>|<model>": packed doubles
-- {EWMA billed prompt tokens, EWMA raw estimate, answers counted}. No I/O.
local config = require("infergate.core.config")
local ffi = require("ffi")

local _M = {}

_M.ALPHA = 0.2
_M.MIN_OBS = 3
_M.FLOOR = 1
_M.CEIL = 8
_M.TTL_S = 600
_M.SPAN = 4

local type = type
local min = math.min
local max = math.max
local ceil = math.ceil
local shared = ngx.shared
local cdouble_p = ffi.typeof("const double *")
local buf = ffi.new("double[3]")
local BYTES = 3 * 8

local function key_of(req)
    return "ptr:" .. (req.key_id or "") .. "|" .. (req.model or "")
end

-- Prompt tokens billed per estimated prompt token for `req`'s key and model: 1 until
-- MIN_OBS answers are known (see the top of this file), then within [FLOOR, CEIL];
-- and the learned mean estimate (nil with 1).
function _M.factor(req)
    local raw = shared[config.DICT_STATS]:get(key_of(req))
    if type(raw) ~= "string" or #raw ~= BYTES then
        return 1
    end
    local rec = ffi.cast(cdouble_p, raw)
    if rec[2] < _M.MIN_OBS or rec[1] <= 0 then
        return 1
    end
    return min(_M.CEIL, max(_M.FLOOR, rec[0] / rec[1])), rec[1]
end

-- The up-front prompt tokens of `req` from its raw estimate `est` (characters /
-- chars_per_token): the factor applied up to SPAN times the learned mean estimate.
function _M.scale(req, est)
    local f, mean = _M.factor(req)
    if f == 1 or not mean then
        return est
    end
    local within = min(est, _M.SPAN * mean)
    return ceil(within * f + (est - within))
end

-- One answer: `billed` prompt tokens (the node's usage) against `estimate` (the raw
-- estimate: characters / chars_per_token, before any factor).
function _M.observe(req, billed, estimate)
    if type(billed) ~= "number" or billed <= 0 or type(estimate) ~= "number"
            or estimate <= 0 then
        return
    end
    local dict = shared[config.DICT_STATS]
    local key = key_of(req)
    local raw = dict:get(key)
    local b, e, n = billed, estimate, 1
    if type(raw) == "string" and #raw == BYTES then
        local rec = ffi.cast(cdouble_p, raw)
        n = rec[2] + 1
        -- the mean of the first answers, then the EWMA (no bias toward the first one)
        local a = max(_M.ALPHA, 1 / n)
        b = rec[0] + a * (billed - rec[0])
        e = rec[1] + a * (estimate - rec[1])
    end
    buf[0], buf[1], buf[2] = b, e, n
    dict:set(key, ffi.string(buf, BYTES), _M.TTL_S)
end

-- Log phase: learns from a request charged to a tokens bucket (req.est_raw set by the
-- rate limiter) whose node answered 2xx with its own usage.
function _M.log(req, status)
    local u = req.usage
    if req.est_raw and u and not u.estimated and status and status >= 200 and status < 300 then
        _M.observe(req, u.prompt_tokens, req.est_raw)
    end
end

return _M
