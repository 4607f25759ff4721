-- The token-bucket script of the rate limits (infergate.admission.ratelimit) and its
-- call in Redis: all buckets of a request checked and charged together, atomically,
-- with the time from Redis TIME (EVALSHA, EVAL after NOSCRIPT).
local ar = require("infergate.admission.redis")
local redis = require("infergate.redis.client")
local pool = require("infergate.redis.pool")

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

local function single_apply(mode, list, costs, extra, on_extra, wants)
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

-- The buckets of `list` grouped by their keys' hash tag ({rl:key:<id>}, {rl:global}):
-- a list of index lists, or nil when one script can take them all (one group, or one
-- Redis, where any keys may share a script).
function _M.cluster_groups(list)
    if #list < 2 then
        return nil
    end
    local conf = pool.conf()
    if not (conf and conf.cluster) then
        return nil
    end
    local groups, by = {}, {}
    for i, b in ipairs(list) do
        local tag = b.key:match("{[^}]*}") or b.key
        local g = by[tag]
        if not g then
            g = {}
            by[tag] = g
            groups[#groups + 1] = g
        end
        g[#g + 1] = i
    end
    return #groups > 1 and groups or nil
end

function _M.pick(t, idx)
    if not t then
        return nil
    end
    local out = {}
    for j, i in ipairs(idx) do
        out[j] = t[i]
    end
    return out
end

-- Gives back what the groups in `charged` ({list, costs, granted}) took.
local function refund(charged)
    for _, c in ipairs(charged) do
        local back = {}
        for j, b in ipairs(c[1]) do
            back[j] = -((c[2] and c[2][j] or b.cost) + (c[3] and c[3][j] or 0))
        end
        single_apply("adjust", c[1], back)
    end
end

-- On a Redis Cluster the per-key and global buckets live in different slots: one script
-- per group; when a group refuses (or fails), the groups that charged are given back
-- their tokens ("adjust" with the negative cost), so all or none are charged as with one
-- script (not atomically: a concurrent request may see a charge that is then undone).
local function split_apply(mode, list, costs, extra, on_extra, wants, groups)
    local out = { allowed = true, tokens = {}, wait = {}, granted = wants and {} or nil }
    local charged = {}
    for gi, idx in ipairs(groups) do
        local sub, subcosts, subwants = _M.pick(list, idx), _M.pick(costs, idx), _M.pick(wants, idx)
        local r, err = single_apply(mode, sub, subcosts, gi == 1 and extra or nil,
                                    gi == 1 and on_extra or nil, subwants)
        if not r then
            if mode ~= "adjust" then
                refund(charged)
            end
            return r, err
        end
        for j, i in ipairs(idx) do
            out.tokens[i], out.wait[i] = r.tokens[j], r.wait[j]
            if wants then
                out.granted[i] = r.granted[j]
            end
        end
        if r.allowed then
            charged[#charged + 1] = { sub, subcosts, r.granted }
        else
            out.allowed = false
        end
    end
    if not out.allowed and mode ~= "adjust" then
        refund(charged)
        if wants then
            for i in ipairs(list) do
                out.granted[i] = 0
            end
        end
    end
    return out
end

-- Runs the script in Redis for `list` (costs override the buckets' costs; wants: mode
-- "lease"): one call, or one per hash-tag group on a Redis Cluster (split_apply).
-- Returns the result, false, err or nil, err (see single_apply).
function _M.redis_apply(mode, list, costs, extra, on_extra, wants)
    local groups = _M.cluster_groups(list)
    if groups then
        return split_apply(mode, list, costs, extra, on_extra, wants, groups)
    end
    return single_apply(mode, list, costs, extra, on_extra, wants)
end

return _M
