-- Token-bucket rate limits (access phase), shared by every edge through Redis.
--
-- Buckets of one request (each refills continuously at capacity / 60 per second and
-- holds at most its capacity, so "N per minute" also allows a burst of N):
--
--   per API key   requests  capacity = the key's rpm, cost 1
--                 tokens    capacity = the key's tpm, cost = estimated prompt tokens
--                           + the output tokens reserved (tokencount.reserved_output:
--                           max_tokens x n, else limits.model_max_tokens[model] or
--                           limits.default_max_tokens; chat and completions only)
--   global        requests  capacity = limits.global_rpm (0 = none), cost 1
--                 tokens    capacity = limits.global_tpm (0 = none), cost as above
--
-- Token estimate up front: ceil(characters of the prompt / limits.chars_per_token),
-- at least 1, times what this key's prompts on this model were billed per estimated
-- token (infergate.admission.promptratio: 1 until learned, at most 8, up to 4 times
-- the key's mean prompt); characters
-- are Unicode code points of the message contents (chat), the prompt (completions) or
-- the input (embeddings). A cost above a bucket's capacity is
-- capped at the capacity (the request waits for a full bucket). After the answer the
-- log phase settles the charge on the real usage.total_tokens of the response (the unused
-- part of the reservation goes back; an answer without usage, e.g. a stream the client
-- left, is settled on the prompt estimate + the content chunks seen; one that is not a
-- stream, left at a node, keeps its reservation: infergate.admission.settlement)
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
-- round trip for both. Hashes keynames.ratelimit_key(<key id>, "rpm" | "tpm") and
-- keynames.ratelimit_global("rpm" | "tpm") with fields tokens, ts (epoch s); they
-- expire once full again.
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
-- Each charge in Redis leaves its buckets' levels there (localbuckets.mirror), so a local
-- bucket goes on from what Redis last reported to this edge instead of starting full.
--
-- Over a limit: 429, Retry-After (integer seconds >= 1), an OpenAI-style error
-- {"type": "requests"|"tokens", "code": "rate_limit_exceeded"}. Every answer (429 or
-- not) carries x-ratelimit-limit-*, x-ratelimit-remaining-* and x-ratelimit-reset-*
-- for requests and tokens (reset as a duration like "1s", "6m0s", "12ms": the time
-- until the bucket is full again); with both a key and a global bucket, the headers
-- show the one with fewer remaining.
--
-- A request bucket (cost 1) that refused a request cannot hold a token again before its
-- wait has passed: this worker refuses the requests of that bucket on its own for that
-- wait, at most REFUSED_MAX_S, without a round trip (a key flooding past its limit
-- costs Redis one script call per bucket and worker per REFUSED_MAX_S, not one per
-- request). Token buckets are not remembered: a smaller request may still fit.
--
-- The parts live in their own modules: infergate.admission.bucketscript (the script
-- and its call in Redis), .localbuckets (the shared-dict buckets), .bucketcharge (one
-- charge, Redis or local), .leases, .settlement (log-phase corrections), .tokencount
-- (the token estimate), .rlheaders (x-ratelimit-* headers, the 429 error).
local ngx_now = require("infergate.core.ngxapi").now
local keynames = require("infergate.redis.keynames")
local astats = require("infergate.admission.stats")
local flush = require("infergate.core.flush")
local bucketscript = require("infergate.admission.bucketscript")
local localbuckets = require("infergate.admission.localbuckets")
local bucketcharge = require("infergate.admission.bucketcharge")
local leases = require("infergate.admission.leases")
local settlement = require("infergate.admission.settlement")
local tokencount = require("infergate.admission.tokencount")
local promptratio = require("infergate.admission.promptratio")
local rlheaders = require("infergate.admission.rlheaders")
local reqctx = require("infergate.core.reqctx")

local config = require("infergate.core.config")

local _M = {}

local ipairs = ipairs
local pairs = pairs
local min = math.min
local max = math.max
local ceil = math.ceil
local tostring = tostring

-- The parts, under their former names.
_M.SCRIPT = bucketscript.SCRIPT
_M.SCRIPT_SHA = bucketscript.SCRIPT_SHA
_M.prompt_chars = tokencount.prompt_chars
_M.estimate_tokens = tokencount.estimate_tokens
_M.duration = rlheaders.duration
_M.headers = rlheaders.headers
_M.apply = bucketcharge.apply
_M._local_apply = localbuckets.apply
_M.sweep_leases = leases.sweep_leases
_M.LEASE_TTL_S = leases.LEASE_TTL_S
_M.LEASE_TARGET_S = leases.LEASE_TARGET_S
_M.LEASE_MAX = leases.LEASE_MAX

-- Log phase: learns the prompt ratio, then settles the charge on the real usage.
function _M.log(req)
    promptratio.log(req, ngx.status)
    settlement.log(req)
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
    return key_names:set(id, { rpm = keynames.ratelimit_key(id, "rpm"),
                                tpm = keynames.ratelimit_key(id, "tpm") })
end

local GLOBAL_RPM = keynames.ratelimit_global("rpm")
local GLOBAL_TPM = keynames.ratelimit_global("tpm")

function _M.buckets(req, o)
    local list = {}
    local tokens = req.est_tokens or 0
    if tokens > 0 then
        tokens = tokens + (req.reserved_tokens or 0)
    end
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

-- Charges the request's buckets `list` (o: the limits options): with leases when
-- limits.lease_fraction > 0. Returns result {allowed, tokens, wait}, source.
local function charge(req, list, o)
    -- a later access step may hand over a Redis read of its own (the exact cache
    -- lookup, infergate.cache.lookup.prefetch): one round trip for both
    local fraction = o.lease_fraction or 0
    if fraction > 0 then
        return leases.leased_charge(req, list, ngx_now(), fraction, _M.companion)
    end
    local extra, on_extra
    if _M.companion then
        extra, on_extra = _M.companion(req)
    end
    return bucketcharge.apply("take", list, nil, extra, on_extra)
end

-- Request buckets that refused lately, in this worker: bucket key -> {until (ngx.now()
-- s), wait (s) at `at`, at, the refusal's error table}.
_M.REFUSED_MAX_S = 1
local refused = require("infergate.core.memo").new(_M.KEY_NAMES_MAX)

local function remember_refusal(list, res, err, now)
    for i, b in ipairs(list) do
        local w = res.wait[i]
        if b.kind == "requests" and w and w > 0 then
            refused:set(b.key, { till = now + min(w, _M.REFUSED_MAX_S), wait = w, at = now,
                                 err = err })
        end
    end
end

-- The refusal of a request bucket in `list` that refused within its wait, brought up to
-- date (Retry-After), or nil.
local function still_refused(list, now)
    for _, b in ipairs(list) do
        local r = b.kind == "requests" and refused:get(b.key)
        if r and r.till > now then
            local h = {}
            for k, v in pairs(r.err.headers) do
                h[k] = v
            end
            h["Retry-After"] = tostring(max(1, ceil(r.wait - (now - r.at))))
            local e = r.err
            return { status = e.status, message = e.message, type = e.type, code = e.code,
                     headers = h }
        end
    end
    return nil
end

-- Access step: nil to continue, or a 429 error table.
function _M.step(req)
    local o = config.get().limits
    if not o.enabled then
        return nil
    end
    -- the token estimate (a walk over the prompt) only when a token bucket may apply
    local kl = req.key_limits
    -- every proxied route (models is answered by the edge): at least 1 token, settled
    -- with the answer's usage
    if req.route ~= "models" and (o.global_tpm > 0 or (kl and kl.tpm)) then
        -- the prompt's characters are counted once per request (infergate.core.reqctx)
        local raw = max(1, ceil(reqctx.prompt_chars(req) / o.chars_per_token))
        req.est_raw = raw
        req.est_tokens = promptratio.scale(req, raw)
        req.reserved_tokens = tokencount.reserved_output(req.body, req.model, o)
    end
    local list = _M.buckets(req, o)
    if #list == 0 then
        return nil
    end
    local now = ngx_now()
    local again = still_refused(list, now)
    if again then
        astats.incr("rate_limited")
        return again
    end
    local res, source = charge(req, list, o)
    local h = rlheaders.headers(list, res)
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
    local err = rlheaders.refusal(list, res, h)
    remember_refusal(list, res, err, now)
    return err
end

flush.on_tick(_M.sweep_leases)

return _M
