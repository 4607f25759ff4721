-- The token-bucket script of the rate limits (infergate.admission.ratelimit) and its
-- call in Redis: all buckets of a request checked and charged together, atomically,
-- with the time from Redis TIME (EVALSHA, EVAL after NOSCRIPT).
local ar = require("infergate.admission.redis")
local redis = require("infergate.redis.client")

local _M = {}

local type = type
local ipairs = ipairs
local unpack = unpack
local tonumber = tonumber
local format = string.format

-- KEYS: bucket hashes. ARGV[1]: "take" (charge all or none) | "adjust" (charge all,
-- cost may be negative) | "lease" (as take, and each bucket also hands out up to `want`
-- tokens more, as many whole ones as it holds beyond the cost). Then capacity, rate per
-- second, cost (and want, for "lease") for each key.
-- Returns {allowed (1|0), tokens_1, wait_s_1, tokens_2, wait_s_2, ...} with the
-- numbers as strings: tokens after the charge (before it when refused) and the seconds
-- until the bucket could pay its cost; "lease" adds granted_i after wait_s_i.
_M.SCRIPT = [[
local t = redis.call("TIME")
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mode = ARGV[1]
local stride = mode == "lease" and 4 or 3
local n = #KEYS
local st = {}
local ok = 1
for i = 1, n do
  local cap = tonumber(ARGV[2 + (i - 1) * stride])
  local rate = tonumber(ARGV[3 + (i - 1) * stride])
  local cost = tonumber(ARGV[4 + (i - 1) * stride])
  local want = stride == 4 and tonumber(ARGV[5 + (i - 1) * stride]) or 0
  local v = redis.call("HMGET", KEYS[i], "tokens", "ts")
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then
    tokens, ts = cap, now
  end
  if now > ts then
    tokens = math.min(cap, tokens + (now - ts) * rate)
  end
  st[i] = { cap, rate, cost, tokens, want }
  if mode ~= "adjust" and tokens < cost then
    ok = 0
  end
end
local out = { ok }
for i = 1, n do
  local cap, rate, cost, tokens, want = st[i][1], st[i][2], st[i][3], st[i][4], st[i][5]
  local wait = 0
  if tokens < cost then
    wait = (cost - tokens) / rate
  end
  local grant = 0
  if ok == 1 then
    if want > 0 then
      grant = math.max(0, math.floor(math.min(want, tokens - cost)))
    end
    tokens = math.max(-cap * 60, math.min(cap, tokens - cost - grant))
    redis.call("HSET", KEYS[i], "tokens", tostring(tokens), "ts", tostring(now))
    redis.call("PEXPIRE", KEYS[i], math.ceil((cap - tokens) / rate * 1000) + 1000)
  end
  out[#out + 1] = tostring(tokens)
  out[#out + 1] = tostring(wait)
  if stride == 4 then
    out[#out + 1] = tostring(grant)
  end
end
return out
]]
_M.SCRIPT_SHA = (ngx.sha1_bin(_M.SCRIPT):gsub(".", function(c)
    return string.format("%02x", c:byte())
end))

-- {numkeys, key..., mode, (capacity, rate, cost[, want])...}: the arguments after the
-- script (want per bucket when `wants` is given: mode "lease").
function _M.script_args(mode, list, costs, wants)
    local n = #list
    local args = { n }
    for i, b in ipairs(list) do
        args[1 + i] = b.key
    end
    args[n + 2] = mode
    for i, b in ipairs(list) do
        args[#args + 1] = b.capacity
        args[#args + 1] = format("%.9g", b.rate)
        args[#args + 1] = costs and costs[i] or b.cost
        if wants then
            args[#args + 1] = wants[i]
        end
    end
    return args
end

local function parse_reply(res, n, leased)
    local stride = leased and 3 or 2
    if type(res) ~= "table" or #res ~= 1 + stride * n then
        return nil, "unexpected rate-limit script reply"
    end
    local out = { allowed = tonumber(res[1]) == 1, tokens = {}, wait = {} }
    if leased then
        out.granted = {}
    end
    for i = 1, n do
        local at = 2 + stride * (i - 1)
        out.tokens[i] = tonumber(res[at]) or 0
        out.wait[i] = tonumber(res[at + 1]) or 0
        if leased then
            out.granted[i] = tonumber(res[at + 2]) or 0
        end
    end
    return out
end

-- Runs the script in Redis for `list` (costs override the buckets' costs; wants: mode
-- "lease"). Returns the result, false, err (an error reply or an unexpected reply) or
-- nil, err (Redis unreachable, or skipped during the back-off of infergate.redis.pool).
local function script_call(c, args, extra, on_extra)
    local r, e
    if extra then
        -- the companion command rides in the same round trip
        local replies, perr = c:pipeline({ { "EVALSHA", _M.SCRIPT_SHA, unpack(args) }, extra })
        if not replies then
            return nil, perr
        end
        on_extra(replies[2])
        r = replies[1]
        e = redis.error_of(r)
        if e then
            r = false
        end
    else
        r, e = c:command("EVALSHA", _M.SCRIPT_SHA, unpack(args))
    end
    if r == false and type(e) == "string" and e:find("^NOSCRIPT") then
        r, e = c:command("EVAL", _M.SCRIPT, unpack(args))
    end
    return r, e
end

function _M.redis_apply(mode, list, costs, extra, on_extra, wants)
    local args = _M.script_args(mode, list, costs, wants)
    local res, err = ar.run(script_call, args, extra, on_extra)
    if not res then
        return res, err
    end
    local out, perr = parse_reply(res, #list, wants ~= nil)
    if not out then
        return false, perr
    end
    return out
end


return _M
