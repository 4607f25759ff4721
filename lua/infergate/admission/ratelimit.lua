-- Token-bucket rate limits (access phase), shared by every edge through Redis.
--
-- Buckets of one request (each refills continuously at capacity / 60 per second and
-- holds at most its capacity, so "N per minute" also allows a burst of N):
--
--   per API key   requests  capacity = the key's rpm, cost 1
--                 tokens    capacity = the key's tpm, cost = estimated prompt tokens
--   global        requests  capacity = limits.global_rpm (0 = none), cost 1
--                 tokens    capacity = limits.global_tpm (0 = none), cost as above
--
-- Token estimate up front: ceil(characters of the prompt / limits.chars_per_token),
-- at least 1; characters are Unicode code points of the message contents (chat), the
-- prompt (completions) or the input (embeddings). A cost above a bucket's capacity is
-- capped at the capacity (the request waits for a full bucket). After the answer the
-- log phase corrects the charge with the real usage.total_tokens of the response
-- (infergate.admission.usage; a stream without usage counts one token per content chunk): the
-- difference goes into the worker's flush queue (infergate.core.flush, one recurring
-- timer per worker) and is applied from there, so the request path never waits on
-- Redis outside the access phase. A request the node refused (4xx, so nothing read or
-- generated) gets its whole estimate back. A correction may leave a bucket
-- below zero, by up to an hour of its rate (DEBT_MINUTES x capacity): later requests wait
-- until it refills, so a request far larger than the limit (charged the capacity up front)
-- still costs its whole usage, and the limit holds on average.
--
-- All buckets of a request are checked and charged together, atomically, by one Lua
-- script in Redis (EVALSHA, EVAL after NOSCRIPT) that takes the time from Redis TIME,
-- so every edge sees the same clock. _M.companion(req) (set by infergate.cache.lookup)
-- may return a Redis command and a callback for its reply: the command goes in the same
-- pipeline as the script, so a request with rate limits and the response cache pays one
-- round trip for both. Hashes under keynames.ratelimit_prefix:
-- "key:<key id>:rpm", "key:<key id>:tpm", "global:rpm", "global:tpm" with fields
-- tokens, ts (epoch s); they expire once full again.
--
-- Leases (limits.lease_fraction > 0): a worker that charges a bucket again within
-- LEASE_TTL_S of its last charge also takes tokens ahead in the same script call (mode
-- "lease": what it charged the bucket per second since the last grant x
-- LEASE_TARGET_S, at least the cost, at most lease_fraction x capacity and LEASE_MAX;
-- as many whole tokens as the bucket holds beyond the cost). A request whose every
-- bucket this worker still holds enough leased tokens for pays from them, with no round
-- trip (the companion command then goes on its own); the buckets whose lease falls
-- short go to Redis as above, in one call, and only they (a key's bucket running dry
-- never draws more from the global one). One request at a time brings a bucket's next
-- lease, sized to what the worker spends less what it still holds, when the last is
-- half spent. A lease
-- lasts LEASE_TTL_S: then the flush timer (infergate.core.flush.on_tick) gives what is
-- left back to the bucket. Leased tokens were charged in Redis before any request
-- spends them, so leases never let more through than the limit; while other workers
-- hold some, a bucket can refuse early by at most what their leases hold. A bucket
-- under 1 / lease_fraction per minute never gets a lease (one round trip per request,
-- exact to the token). The x-ratelimit-remaining-* headers count this worker's leased
-- tokens as remaining.
--
-- Redis unreachable or backed off (infergate.admission.redis, infergate.redis.pool): the
-- same buckets live in this edge's infergate_limits shared dict, so limits then apply
-- per edge (N edges allow up to N times the limit), and requests are never failed for it.
--
-- Over a limit: 429, Retry-After (integer seconds >= 1), an OpenAI-style error
-- {"type": "requests"|"tokens", "code": "rate_limit_exceeded"}. Every answer (429 or
-- not) carries x-ratelimit-limit-*, x-ratelimit-remaining-* and x-ratelimit-reset-*
-- for requests and tokens (reset as a duration like "1s", "6m0s", "12ms": the time
-- until the bucket is full again); with both a key and a global bucket, the headers
-- show the one with fewer remaining.
local options = require("infergate.admission.options")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local keynames = require("infergate.redis.keynames")
local ar = require("infergate.admission.redis")
local astats = require("infergate.admission.stats")
local flush = require("infergate.core.flush")
local reqctx = require("infergate.core.reqctx")
local request_body = require("infergate.core.body")
local redis = require("infergate.redis.client")

local _M = {}

local type = type
local ipairs = ipairs
local pairs = pairs
local unpack = unpack
local tonumber = tonumber
local tostring = tostring
local floor = math.floor
local ceil = math.ceil
local min = math.min
local max = math.max
local format = string.format
local log = ngx.log
local ERR = ngx.ERR

-- Most a bucket can owe, in minutes of its rate (the script below writes it as 60).
local DEBT_MINUTES = 60

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

local function dict()
    return ngx.shared[options.DICT_LIMITS]
end

-- Characters of the prompt of a decoded request body (infergate.core.body.prompt_chars).
_M.prompt_chars = request_body.prompt_chars

-- Estimated prompt tokens: ceil(chars / chars_per_token), at least 1.
function _M.estimate_tokens(body, chars_per_token)
    return max(1, ceil(_M.prompt_chars(body) / chars_per_token))
end

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

-- The buckets a request is charged to (see the header).
-- (no closure per request: a function created on the hot path stops the JIT compiler)
local function add_bucket(list, kind, scope, key, capacity, cost)
    list[#list + 1] = {
        kind = kind, scope = scope, key = key, capacity = capacity,
        rate = capacity / 60, cost = min(cost, capacity),
    }
end

-- Bucket key names of an API key id, per worker (emptied past KEY_NAMES_MAX ids).
_M.KEY_NAMES_MAX = 10000
local key_names = require("infergate.core.memo").new(_M.KEY_NAMES_MAX)

local function names_of(id)
    local n = key_names:get(id)
    if n then
        return n
    end
    local prefix = keynames.ratelimit_prefix
    return key_names:set(id, { rpm = prefix .. "key:" .. id .. ":rpm",
                                tpm = prefix .. "key:" .. id .. ":tpm" })
end

local GLOBAL_RPM = keynames.ratelimit_prefix .. "global:rpm"
local GLOBAL_TPM = keynames.ratelimit_prefix .. "global:tpm"

function _M.buckets(req, o)
    local list = {}
    local tokens = req.est_tokens or 0
    local kl, id = req.key_limits, req.key_id
    if kl and id and id ~= "" then
        if kl.rpm then
            add_bucket(list, "requests", "key", names_of(id).rpm, kl.rpm, 1)
        end
        if kl.tpm and tokens > 0 then
            add_bucket(list, "tokens", "key", names_of(id).tpm, kl.tpm, tokens)
        end
    end
    if o.global_rpm > 0 then
        add_bucket(list, "requests", "global", GLOBAL_RPM, o.global_rpm, 1)
    end
    if o.global_tpm > 0 and tokens > 0 then
        add_bucket(list, "tokens", "global", GLOBAL_TPM, o.global_tpm, tokens)
    end
    return list
end

-- {numkeys, key..., mode, (capacity, rate, cost[, want])...}: the arguments after the
-- script (want per bucket when `wants` is given: mode "lease").
local function script_args(mode, list, costs, wants)
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

local function redis_apply(mode, list, costs, extra, on_extra, wants)
    local args = script_args(mode, list, costs, wants)
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

-- The same algorithm on this edge's shared dict (Redis down). "b:<key>" = "tokens ts".
local function lock()
    local d = dict()
    for _ = 1, 50 do
        if d:add("lock:buckets", true, 0.1) then
            return true
        end
        ngx.sleep(0.001)
    end
    return false
end

local function local_apply(mode, list, costs)
    local d = dict()
    local locked = lock()
    ngx.update_time()
    local now = ngx_now()
    local st, ok = {}, true
    for i, b in ipairs(list) do
        local cost = costs and costs[i] or b.cost
        local raw = d:get("b:" .. b.key)
        local tokens, ts
        if raw then
            tokens, ts = raw:match("^(%S+) (%S+)$")
            tokens, ts = tonumber(tokens), tonumber(ts)
        end
        if not tokens or not ts then
            tokens, ts = b.capacity, now
        end
        if now > ts then
            tokens = min(b.capacity, tokens + (now - ts) * b.rate)
        end
        st[i] = { tokens, cost }
        if mode == "take" and tokens < cost then
            ok = false
        end
    end
    local out = { allowed = ok, tokens = {}, wait = {} }
    for i, b in ipairs(list) do
        local tokens, cost = st[i][1], st[i][2]
        out.wait[i] = tokens < cost and (cost - tokens) / b.rate or 0
        if ok then
            tokens = max(-b.capacity * DEBT_MINUTES, min(b.capacity, tokens - cost))
            d:set("b:" .. b.key, format("%.6f %.6f", tokens, now),
                  (b.capacity - tokens) / b.rate + 1)
        end
        out.tokens[i] = tokens
    end
    if locked then
        d:delete("lock:buckets")
    end
    return out
end
_M._local_apply = local_apply

-- Charges `list` (mode "take"; "lease" with wants: also takes up to wants[i] tokens
-- ahead, result.granted[i]) or corrects it (mode "adjust", costs per bucket).
-- extra, on_extra (optional): one more Redis command sent in the same pipeline, and
-- on_extra(reply) called with its reply (not called when Redis was not reached).
-- Returns result {allowed, tokens = {}, wait = {}[, granted = {}]}, source
-- "redis"|"local" (local buckets grant no lease).
function _M.apply(mode, list, costs, extra, on_extra, wants)
    local res, err = redis_apply(mode, list, costs, extra, on_extra, wants)
    if res then
        return res, "redis"
    end
    if res == false then
        -- a Redis error reply (not an outage): say so, decide locally this time
        log(ERR, "infergate: rate-limit script failed: ", err)
    end
    astats.incr("limits_local")
    return local_apply(mode == "lease" and "take" or mode, list, costs), "local"
end

-- Leases (worker-local, see the header): bucket key -> {left = tokens leased and not
-- spent, at = ngx.now() of the last grant, spent = tokens this worker charged to the
-- bucket since then, tokens = the bucket's tokens in Redis after that grant, refilling =
-- ngx.now() when a request went for the next lease, bucket}.
_M.LEASE_TTL_S = 1
-- A lease is sized to last this long at the worker's recent rate on the bucket.
_M.LEASE_TARGET_S = 0.25
_M.LEASE_MAX = 1000
local leases = {}

-- Gives the unspent tokens of an expired lease back to its bucket (flush queue).
local queue_correction
local function refund(b, left)
    if left > 0 then
        queue_correction({ b }, { -left }, "redis")
    end
end

local function refill_under_way(l, now)
    return l.refilling ~= nil and now - l.refilling < _M.LEASE_TTL_S
end

local function live_lease(b, now)
    local l = leases[b.key]
    if l and now - l.at < _M.LEASE_TTL_S then
        return l
    end
    return nil
end

-- What a bucket's lease shows as remaining: the bucket's tokens in Redis at the last
-- grant, refilled since, plus this worker's leased tokens.
local function lease_remaining(l, b, now)
    return min(b.capacity, l.tokens + (now - l.at) * b.rate) + l.left
end

-- Tokens to lease ahead per bucket of `list` (the buckets a request takes to Redis):
-- none for a bucket this worker has not charged within LEASE_TTL_S or whose next lease
-- another request is already bringing; else what this worker charged it per second
-- since the last grant x LEASE_TARGET_S, less what it still holds (at least the cost
-- when any, at most lease_fraction x capacity and LEASE_MAX). That request then brings
-- the next lease (refilling).
local function lease_wants(list, now, fraction)
    local wants = {}
    for i, b in ipairs(list) do
        local l = live_lease(b, now)
        local w = 0
        if l and not refill_under_way(l, now) then
            local dt = now - l.at
            if dt < 0.001 then
                dt = 0.001
            end
            w = ceil((l.spent + b.cost) / dt * _M.LEASE_TARGET_S) - l.left
            if w > 0 and w < b.cost then
                w = b.cost
            end
            local most = floor(b.capacity * fraction)
            if most > _M.LEASE_MAX then
                most = _M.LEASE_MAX
            end
            if w > most then
                w = most
            end
            if w > 0 then
                l.refilling = now
            else
                w = 0
            end
        end
        wants[i] = w
    end
    return wants
end

-- After the script call of mode "lease" for `list` (at `now`): keeps what Redis granted
-- (when it was Redis and the request was allowed; res.tokens then count this worker's
-- leased tokens as remaining too), and ends this request's refill either way.
local function lease_store(list, res, source, now, wants)
    local ok = source == "redis" and res.allowed
    for i, b in ipairs(list) do
        local l = leases[b.key]
        if l and now - l.at >= _M.LEASE_TTL_S then
            refund(b, l.left)
            leases[b.key] = nil
            l = nil
        end
        if ok then
            if not l then
                l = { left = 0, at = now, spent = 0, tokens = res.tokens[i], bucket = b, size = 0 }
                leases[b.key] = l
            end
            l.spent = l.spent + b.cost
            if wants[i] > 0 then
                l.left = l.left + (res.granted[i] or 0)
                l.at, l.spent, l.size, l.tokens = now, 0, wants[i], res.tokens[i]
            end
            res.tokens[i] = res.tokens[i] + l.left
        end
        if l and wants[i] > 0 then
            l.refilling = nil
        end
    end
end

-- Charges a request with leases on: each bucket whose lease covers the cost (and is not
-- down to half its size with no refill under way) pays from it; the others go to Redis
-- together in one script call that also brings their next leases. The leased share is
-- set aside before the call (other requests of the worker run while it waits) and given
-- back when Redis refuses. Returns result {allowed, tokens, wait} over `list`, source.
local function leased_charge(req, list, now, fraction)
    local remote, held = nil, {}   -- indices to Redis; index -> lease paying
    for i, b in ipairs(list) do
        local l = live_lease(b, now)
        if l and l.left >= b.cost
                and (l.left - b.cost >= l.size / 2 or refill_under_way(l, now)) then
            held[i] = l
            l.left = l.left - b.cost   -- set aside
        else
            remote = remote or {}
            remote[#remote + 1] = i
        end
    end
    local out = { allowed = true, tokens = {}, wait = {} }
    local source = "redis"  -- a lease was charged in Redis when it was granted
    if remote then
        local sub = {}
        for j, i in ipairs(remote) do
            sub[j] = list[i]
        end
        local extra, on_extra
        if _M.companion then
            extra, on_extra = _M.companion(req)
        end
        local wants = lease_wants(sub, now, fraction)
        local r
        r, source = _M.apply("lease", sub, nil, extra, on_extra, wants)
        ngx.update_time()
        lease_store(sub, r, source, ngx_now(), wants)
        out.allowed = r.allowed
        for j, i in ipairs(remote) do
            out.tokens[i], out.wait[i] = r.tokens[j], r.wait[j]
        end
    end
    for i, b in ipairs(list) do
        local l = held[i]
        if l then
            if out.allowed then
                l.spent = l.spent + b.cost
            else
                l.left = l.left + b.cost   -- refused: the set-aside tokens go back
            end
            out.tokens[i] = lease_remaining(l, b, now)
            out.wait[i] = 0
        end
    end
    return out, source
end

-- Flush timer: expired leases go back to their buckets and are forgotten.
function _M.sweep_leases(now)
    now = now or ngx_now()
    for key, l in pairs(leases) do
        if now - l.at >= _M.LEASE_TTL_S then
            leases[key] = nil
            refund(l.bucket, l.left)
        end
    end
end

-- x-ratelimit-* headers: for each kind, the bucket with the fewest remaining.
local HEADER_NAMES = {}
for _, kind in ipairs({ "requests", "tokens" }) do
    HEADER_NAMES[kind] = { "x-ratelimit-limit-" .. kind, "x-ratelimit-remaining-" .. kind,
                           "x-ratelimit-reset-" .. kind }
end

local function header_values(h, b, tokens)
    local names = HEADER_NAMES[b.kind]
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

-- Access step: nil to continue, or a 429 error table.
function _M.step(req)
    local o = options.get().limits
    if not o.enabled then
        return nil
    end
    -- the token estimate (a walk over the prompt) only when a token bucket may apply
    local kl = req.key_limits
    if req.route == "inference" and (o.global_tpm > 0 or (kl and kl.tpm)) then
        -- the prompt's characters are counted once per request (infergate.core.reqctx)
        req.est_tokens = max(1, ceil(reqctx.prompt_chars(req) / o.chars_per_token))
    end
    local list = _M.buckets(req, o)
    if #list == 0 then
        return nil
    end
    -- a later access step may hand over a Redis read of its own (the exact cache
    -- lookup, infergate.cache.lookup.prefetch): one round trip for both
    local fraction = o.lease_fraction or 0
    local res, source
    if fraction > 0 then
        res, source = leased_charge(req, list, ngx_now(), fraction)
    else
        local extra, on_extra
        if _M.companion then
            extra, on_extra = _M.companion(req)
        end
        res, source = _M.apply("take", list, nil, extra, on_extra)
    end
    local h = _M.headers(list, res)
    if res.allowed then
        req.ratelimit = { list = list, source = source }
        for _, b in ipairs(list) do
            if b.kind == "tokens" then
                req.track_usage = true
            end
        end
        local out = req.headers_out
        if out then
            for k, v in pairs(h) do
                out[k] = v
            end
        else
            req.headers_out = h
        end
        return nil
    end
    astats.incr("rate_limited")
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

-- The correction of `list` by `costs` in the worker's flush queue: the script in Redis
-- (EVALSHA; EVAL queued again after NOSCRIPT), or the local buckets when the charge was
-- local or Redis cannot be reached (run in the flush timer, where waiting is allowed).
function queue_correction(list, costs, source, full_script)
    local cmds = {}
    if source == "redis" then
        local args = script_args("adjust", list, costs)
        if full_script then
            cmds[1] = { "EVAL", _M.SCRIPT, unpack(args) }
        else
            cmds[1] = { "EVALSHA", _M.SCRIPT_SHA, unpack(args) }
        end
    end
    return flush.push("ratelimit_correction", cmds, function(replies, err)
        if err == "queue full" then
            return
        end
        if replies and replies[1] ~= nil then
            local rerr = redis.error_of(replies[1])
            if not rerr then
                return
            end
            if rerr:find("^NOSCRIPT") and not full_script then
                queue_correction(list, costs, source, true)
                return
            end
            log(ngx.INFO, "infergate: token correction not applied in Redis: ", rerr)
        elseif err then
            log(ngx.INFO, "infergate: token correction not applied in Redis: ", err)
        end
        local ok, lerr = pcall(local_apply, "adjust", list, costs)
        if not ok then
            log(ERR, "infergate: token correction failed: ", lerr)
        end
    end)
end

-- Log phase: charge the difference between the real token usage and the estimate.
-- No I/O here: the correction goes into the worker's flush queue (infergate.core.flush),
-- written to Redis by its timer; a full queue drops it (counted in
-- infergate_edge_flush_dropped_total{kind="ratelimit_correction"}).
-- A request a node refused (its answer, the one the client got, is 4xx: a context too
-- long, a parameter it rejects, 429 busy) read and generated nothing: the estimate is
-- given back whole, as OpenAI charges nothing for a refused request.
local function node_refused()
    local st = ngx.status
    if not st or st < 400 or st >= 500 then
        return false
    end
    local us = ngx_var("upstream_status")
    local last = us and tonumber(us:match("(%d+)%s*$"))
    return last ~= nil and last == st
end

function _M.log(req)
    local rl = req.ratelimit
    local usage = req.usage
    if not rl then
        return
    end
    local total = usage and usage.total_tokens
    if not total then
        if not req.track_usage or not node_refused() then
            return
        end
        total = 0
    end
    local list, costs, any = {}, {}, false
    for _, b in ipairs(rl.list) do
        if b.kind == "tokens" then
            local delta = total - b.cost
            if delta ~= 0 then
                list[#list + 1] = b
                costs[#costs + 1] = delta
                any = true
            end
        end
    end
    if not any then
        return
    end
    queue_correction(list, costs, rl.source)
end

flush.on_tick(_M.sweep_leases)

return _M
