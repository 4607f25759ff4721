-- Response cache lookup in the access phase (exact in Redis, then semantic through the
-- embedder), request coalescing, and serving hits.
--
--   init_by_lua:  assert(require("infergate.cache.lookup").init())   -- after config.init
--
-- init() reads the [cache] options from infergate.core.config (validated there); step()
-- is the "cache" access step (infergate.phases runs it before "eligible" and
-- "admission", so hits are answered after auth and rate limits but without any node and
-- regardless of node saturation).
--
-- The step, for POST /v1/chat/completions and /v1/completions with a JSON body:
--   * BYPASS (neither read nor stored): Cache-Control: no-store; a body over
--     max_request_bytes (its key would cost a canonical encoding of it); content parts other
--     than text (image, audio, file); n > 1; several prompts; logprobs asked (token
--     positions cannot be replayed); temperature above max_temperature (absent = 1.0, the
--     API default).
--   * Cache-Control: no-cache: not read, the fresh answer is stored (BYPASS).
--   * exact: GET infergate:v1:cache:entry:<key>, in the same pipeline as the rate-limit
--     script when limits apply (prefetch, infergate.admission.ratelimit.companion: one
--     round trip for both); Redis down or answering an error ->
--     BYPASS, nothing stored (through infergate.redis.pool: after a failure every worker
--     skips Redis for the pool's back-off, limits.redis_retry_s, 1 s by default).
--   * coalescing: on an exact miss the first request takes a lock in the shared dict
--     (its TTL the leader's deadline, at least coalesce_wait_s); identical requests
--     arriving meanwhile poll the lock every coalesce_poll_ms and serve the entry as an
--     exact HIT once the lock is gone, or go on to a node when their wait ends
--     (infergate.cache.coalesce: their deadline, a stream's coalesce_wait_s) or the
--     leader ended without a storable answer (the lock then holds NOSTORE for
--     capture.NOSTORE_TTL_S, and identical requests in that time go to a node without
--     waiting).
--   * semantic (when the request has a namespace): subrequest to the internal location
--     /_infergate/cache/lookup (proxy_pass to the embedder's POST /v1/lookups, timeouts =
--     semantic_budget_ms); the lookups a worker gets while MAX_FLIGHTS of its calls are in
--     flight wait (up to semantic_budget_ms) and go out together in the next call
--     (infergate.cache.batch, group commit); any failure or timeout -> BYPASS (the answer
--     is still stored).
--     After EMBEDDER_BREAKER_FAILURES failed lookup calls in a row (no answer, a timeout,
--     a 5xx, not JSON) every worker skips the lookup for EMBEDDER_COOLDOWN_S (BYPASS,
--     reason "embedder_breaker_open"): a hung embedder then costs requests nothing
--     instead of the whole budget each; after the cooldown lookups go out again, the
--     first failure opens the breaker again, a success closes it. A call that timed
--     out within EMBEDDER_BUSY_S of one that succeeded is the embedder busy with a burst:
--     BYPASS, not counted. Every lookup counts in
--     infergate_edge_semantic_lookups_total{outcome} (infergate.core.prometheus).
--     A hit whose entry is gone (expired, purged), or whose stored namespace or tenant
--     is not the request's, is a miss.
--   * miss -> MISS, the node's answer is captured (infergate.cache.capture); a stream
--     that will be stored and did not ask for stream_options.include_usage asks the node
--     for it (with_usage, below; cache.stream_usage), the client never sees that chunk.
--   * a semantic hit that shows usage reports prompt_tokens estimated for the requesting
--     prompt (semantic_usage, replay.scaled_usage); exact hits the stored figures.
--   * every hit carries X-Cache-Entry: the exact key hex of the entry it was served from
--     (infergate:v1:cache:entry:<id>, also the id of its semantic vector), which an
--     operator can flag as wrong (POST /api/v1/cache/entries/<id>/flag), and counts
--     hits_exact / hits_semantic on its namespace's hash (keynames.cache_ns_stats, TTL
--     NS_STATS_TTL_S) through the flush queue.
--   * online verification: a share cache.verify_fraction of semantic hits is also queued
--     (flush queue, no timer: RPUSH onto keynames.cache_verify_queue, LTRIM to
--     cache.verify_queue_max, EXPIRE VERIFY_QUEUE_TTL_S) with the request body for the
--     control plane to check (controlplane.cache.verify); the hit is served all the same.
-- The request's cache state is req.cache (see capture.lua for the fields it reads).
--
-- The parts live in their own modules: infergate.cache.policy (BYPASS policy, the
-- request's cache state), .entry (entries read from Redis), .hotcache (worker-local
-- copies), .coalesce, .semantic (with .embedder, the breaker), .serve (hits, counts,
-- verification queue), .streamusage (stream_options rewrite), .shared (names, limits).
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local config = require("infergate.core.config")
local keynames = require("infergate.redis.keynames")
local redis = require("infergate.redis.client")
local shared = require("infergate.cache.shared")
local policy = require("infergate.cache.policy")
local entries = require("infergate.cache.entry")
local hotcache = require("infergate.cache.hotcache")
local coalesce = require("infergate.cache.coalesce")
local embedder = require("infergate.cache.embedder")
local semantic = require("infergate.cache.semantic")
local serve = require("infergate.cache.serve")
local streamusage = require("infergate.cache.streamusage")

local _M = {}

local ipairs = ipairs
local log = ngx.log
local WARN = ngx.WARN

-- Names and limits (defined in the modules that use them, kept here for callers).
_M.DICT = shared.DICT
_M.LOOKUP_LOCATION = shared.LOOKUP_LOCATION
_M.PATHS = shared.PATHS
_M.LOG_EVERY_S = shared.LOG_EVERY_S
_M.MAX_TEXT_BYTES = shared.MAX_TEXT_BYTES
_M.ENTRY_HEADER = shared.ENTRY_HEADER
_M.NS_STATS_TTL_S = shared.NS_STATS_TTL_S
_M.VERIFY_QUEUE_TTL_S = shared.VERIFY_QUEUE_TTL_S
_M.VERIFY_MAX_BODY_BYTES = shared.VERIFY_MAX_BODY_BYTES
_M.NOSTORE = shared.NOSTORE
_M.HOT_MAX_ENTRIES = hotcache.HOT_MAX_ENTRIES
_M.HOT_MAX_BYTES = hotcache.HOT_MAX_BYTES
_M.EMBEDDER_BREAKER_FAILURES = embedder.EMBEDDER_BREAKER_FAILURES
_M.EMBEDDER_COOLDOWN_S = embedder.EMBEDDER_COOLDOWN_S
_M.EMBEDDER_BUSY_S = embedder.EMBEDDER_BUSY_S

-- Functions of the parts, under their former names.
_M.with_usage = streamusage.with_usage
_M.bad_params = policy.bad_params
_M.uncacheable = policy.uncacheable
_M.cut_utf8 = shared.cut_utf8
_M.parse_entry = entries.parse_entry
_M._queue_verify = serve.queue_verify
_M._semantic_usage = semantic.semantic_usage

local opts = nil

-- The "cache" access step (infergate.phases).
local function step(req)
    local e = _M.lookup(req)
    local c = req.cache
    if c and c.store then
        if ngx_var("http_accept_encoding") then
            ngx.req.clear_header("Accept-Encoding")
        end
        if c.stream and not c.include_usage and not c.usage_added
            and opts.stream_usage ~= false then
            streamusage.ask_usage(req, c)
        end
    end
    return e
end
_M.step = step

-- Takes the cache options from the validated edge options (infergate.core.config,
-- checked there against the rendered spec: every default and range lives in the
-- [cache] section of controlplane/config/) and, when enabled, hands the exact lookup
-- to the rate-limit script (the access step itself is listed in infergate.phases).
-- Returns true or nil, err.
function _M.init()
    local ok, o = pcall(config.get)
    if not ok then
        return nil, o
    end
    opts = o.cache
    for _, part in ipairs({ policy, hotcache, coalesce, semantic, serve }) do
        part.configure(opts)
    end
    if opts.enabled and not _M.installed then
        -- the exact GET rides in the rate-limit script's round trip
        require("infergate.admission.ratelimit").companion = _M.prefetch
        _M.installed = true
    end
    return true
end

function _M.options()
    return opts
end

-- For the rate-limit step (infergate.admission.ratelimit.companion): the exact lookup's
-- GET, sent in the pipeline of the rate-limit script, and the callback that keeps its
-- reply for the cache step. nil when the request does no exact lookup.
function _M.prefetch(req)
    local c, k = policy.prepare(req)
    if not k or hotcache.get(k.exact, ngx_now()) then
        return nil -- no lookup, or this worker holds the entry
    end
    return { "GET", keynames.cache_entry(k.exact) }, function(reply)
        c.prefetched = reply
    end
end

local last_down_log = -math.huge

-- The exact lookup: this worker's copy, the reply fetched with the rate-limit script, or
-- a GET of its own. Returns the entry or nil, and err when Redis failed.
local function exact(c, k)
    local pre = c.prefetched
    local doc = hotcache.get(k.exact, ngx_now())
    if doc then
        return entries.parse_doc(doc, c)
    elseif pre ~= nil and pre ~= false and redis.error_of(pre) == nil then
        return entries.entry_of(pre, k.exact, c)
    end
    return shared.with_redis(entries.get_entry, k.exact, c)
end

-- The access step. Returns nil (go on) or ends the request with a cached answer.
function _M.lookup(req)
    local c, k = policy.prepare(req)
    req.cache = c
    if not k then
        return nil
    end

    local entry, err = exact(c, k)
    if err then
        -- at most one line every LOG_EVERY_S per worker: a saturated worker whose Redis
        -- reads time out now and then must not flood the error log
        local now = ngx_now()
        if now - last_down_log >= shared.LOG_EVERY_S then
            log(WARN, "infergate: cache lookup skipped, Redis unavailable: ", err)
            last_down_log = now
        end
        return policy.bypass(c, "redis", false)
    end
    if entry then
        return serve.serve(req, c, entry, "exact", 1)
    end

    entry = coalesce.run(req, c, k)
    if entry then
        return serve.serve(req, c, entry, "exact", 1)
    end

    local decided, res = semantic.run(req, c, k)
    if decided then
        return res
    end
    c.status = "MISS"
    c.store = true
    return nil
end

return _M
