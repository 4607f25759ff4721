-- What a rate-limited answer shows (infergate.admission.ratelimit): the
-- x-ratelimit-limit-*, x-ratelimit-remaining-* and x-ratelimit-reset-* headers (for each
-- kind, the bucket with the fewest remaining), and the 429 error of a refused request.
local _M = {}

local ipairs = ipairs
local tostring = tostring
local floor = math.floor
local ceil = math.ceil
local max = math.max
local format = string.format

-- Duration the way OpenAI's x-ratelimit-reset-* headers write it: "12ms", "1s",
-- "1.5s", "6m0s", "1h2m3s" (Go time.Duration style, rounded up to the millisecond).
function _M.duration(seconds)
    local ms = ceil((seconds or 0) * 1000 - 1e-6)
    if ms <= 0 then
        return "0s"
    end
    if ms < 1000 then
        return ms .. "ms"
    end
    local h = floor(ms / 3600000)
    local m = floor(ms % 3600000 / 60000)
    local s = (ms % 60000) / 1000
    local sec = format("%.3f", s):gsub("0+$", ""):gsub("%.$", "")
    local out = ""
    if h > 0 then
        out = h .. "h"
    end
    if h > 0 or m > 0 then
        out = out .. m .. "m"
    end
    return out .. sec .. "s"
end

-- x-ratelimit-* headers: for each kind, the bucket with the fewest remaining.
local HEADER_NAMES = {}
for _, kind in ipairs({ "requests", "tokens" }) do
    HEADER_NAMES[kind] = { "x-ratelimit-limit-" .. kind, "x-ratelimit-remaining-" .. kind,
                           "x-ratelimit-reset-" .. kind }
end

local function header_values(h, b, tokens)
    local names = HEADER_NAMES[b.kind]
    -- at most the capacity: what a worker holds granted ahead (infergate.admission.leases)
    -- or settled back after an answer used fewer tokens is not more than the limit
    if tokens > b.capacity then
        tokens = b.capacity
    end
    h[names[1]] = tostring(b.capacity)
    h[names[2]] = tostring(max(0, floor(tokens)))
    h[names[3]] = _M.duration(max(0, (b.capacity - tokens) / b.rate))
end

function _M.headers(list, res)
    local h = {}
    local best_req, best_tok -- index of the bucket with the fewest remaining, per kind
    for i, b in ipairs(list) do
        local tokens = res.tokens[i]
        if b.kind == "requests" then
            if not best_req or tokens < res.tokens[best_req] then
                best_req = i
            end
        elseif not best_tok or tokens < res.tokens[best_tok] then
            best_tok = i
        end
    end
    if best_req then
        header_values(h, list[best_req], res.tokens[best_req])
    end
    if best_tok then
        header_values(h, list[best_tok], res.tokens[best_tok])
    end
    return h
end

local WHO = { key = "this API key", global = "this gateway (all clients together)" }
local PER = { requests = "requests per minute (RPM)", tokens = "tokens per minute (TPM)" }

-- The 429 error table of a request refused for `list` (res: the charge's result, with
-- the wait per bucket; h: the headers of the answer, which get Retry-After).
function _M.refusal(list, res, h)
    local worst, wait = 1, 0
    for i, w in ipairs(res.wait) do
        if w > wait then
            worst, wait = i, w
        end
    end
    local b = list[worst]
    local retry = max(1, ceil(wait))
    h["Retry-After"] = tostring(retry)
    local msg = "Rate limit reached for " .. WHO[b.scope] .. " on " .. PER[b.kind] .. ": limit "
        .. b.capacity
    if b.kind == "tokens" then
        msg = msg .. ", this request needs about " .. b.cost
    end
    return {
        status = 429,
        message = msg .. ". Please try again in " .. _M.duration(wait) .. ".",
        type = b.kind,
        code = "rate_limit_exceeded",
        headers = h,
    }
end

return _M
