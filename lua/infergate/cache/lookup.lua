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
--     than text (image, audio, file); n > 1; logprobs asked (token positions cannot be
--     replayed); temperature above max_temperature (absent = 1.0, the API default).
--   * Cache-Control: no-cache: not read, the fresh answer is stored (BYPASS).
--   * exact: GET infergate:v1:cache:entry:<key>, in the same pipeline as the rate-limit
--     script when limits apply (prefetch, infergate.admission.ratelimit.companion: one
--     round trip for both); Redis down or answering an error ->
--     BYPASS, nothing stored (through infergate.redis.pool: after a failure every worker
--     skips Redis for the pool's back-off, limits.redis_retry_s, 1 s by default).
--   * coalescing: on an exact miss the first request takes a lock in the shared dict
--     (add with TTL coalesce_wait_s); identical requests arriving meanwhile poll the lock
--     every coalesce_poll_ms and serve the entry as an exact HIT once the lock is gone,
--     or go on to a node when coalesce_wait_s passed or the leader ended without a
--     storable answer (the lock then holds NOSTORE for capture.NOSTORE_TTL_S, and
--     identical requests in that time go to a node without waiting).
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
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local config = require("infergate.core.config")
local keynames = require("infergate.redis.keynames")
local pool = require("infergate.redis.pool")
local redis = require("infergate.redis.client")
local cachekey = require("infergate.cache.key")
local replay = require("infergate.cache.replay")
local batch = require("infergate.cache.batch")
local prometheus = require("infergate.core.prometheus")
local flush = require("infergate.core.flush")
local reqctx = require("infergate.core.reqctx")

local _M = {}

local type = type
local pairs = pairs
local ipairs = ipairs
local floor = math.floor
local tostring = tostring
local tonumber = tonumber
local setmetatable = setmetatable
local byte = string.byte
local sub = string.sub
local null = cjson.null
local log = ngx.log
local WARN = ngx.WARN
local DEBUG = ngx.DEBUG

_M.DICT = "infergate_cache"
_M.LOOKUP_LOCATION = "/_infergate/cache/lookup"
_M.PATHS = { ["/v1/chat/completions"] = "chat", ["/v1/completions"] = "text" }
-- Shortest time between two "lookup skipped" lines of a worker, seconds.
_M.LOG_EVERY_S = 10
--- Longest last-user text sent to the embedder (bytes, cut on a character boundary).
_M.MAX_TEXT_BYTES = 16384
-- Header naming the entry a hit was served from (its exact key hex).
_M.ENTRY_HEADER = "X-Cache-Entry"
-- TTL (s) of the per-namespace figures, renewed by every count (= the global counters').
_M.NS_STATS_TTL_S = 30 * 86400
-- TTL (s) of the verification queue, renewed by every push
-- (controlplane.cache.verify.QUEUE_TTL_S).
_M.VERIFY_QUEUE_TTL_S = 86400
-- Request bodies larger than this (bytes) are not queued for verification.
_M.VERIFY_MAX_BODY_BYTES = 65536

local opts = nil

-- ------------------------------------------------------------------ usage of streams

-- A stream whose answer will be stored (MISS, or BYPASS that still stores) and that did
-- not ask for stream_options.include_usage is sent to the node with
-- "stream_options": {"include_usage": true}, so the stored entry carries usage and can
-- answer any later request; infergate.cache.capture strips the usage-only chunk from
-- what the client receives. The body is rewritten as text, every other byte as the
-- client sent it: without "stream_options" the member is put right after the opening
-- brace; with one (e.g. {"include_usage": false, "continuous_usage_stats": true}) only
-- its value is replaced, when it occurs once in the body and is a scalar or a flat
-- object, else the body is left alone. The cache key was worked out from the decoded
-- body before (and never holds stream_options).
--
-- Accept-Encoding is dropped from every request whose answer will be stored, streamed
-- or not: a compressed answer (from a node behind a compressing proxy; OpenAI SDKs send
-- "gzip, deflate" on every request) could be neither stored nor stripped. The answer
-- reaches the client uncompressed, as from vLLM, which does not compress.
local USAGE_MEMBER = '"stream_options":{"include_usage":true},'
local find = string.find

-- Position in the body text just before the value of its "stream_options" member, or
-- nil, err. The member's one occurrence: a '"stream_options"' whose opening quote is not
-- escaped (an even number of backslashes before it), followed by ':', is a key; the top
-- level's, when the body has only one.
local function stream_options_at(text)
    local e, pos, n = nil, 1, 0
    while true do
        local s1, e1 = find(text, '"stream_options"%s*:%s*', pos)
        if not s1 then
            break
        end
        local b = s1 - 1
        while b > 0 and byte(text, b) == 92 do -- a backslash
            b = b - 1
        end
        if (s1 - 1 - b) % 2 == 0 then
            n = n + 1
            e = e1
        end
        pos = e1 + 1
    end
    if n ~= 1 then
        return nil, "stream_options not found once"
    end
    return e
end

-- Whether a decoded stream_options table was a JSON object in the body: cjson decodes
-- [] and {} alike (and [x] to a table with [1]), and a node refuses an array there.
local function options_object(so)
    if so[1] ~= nil then
        return false
    end
    if next(so) ~= nil then
        return true
    end
    local req = reqctx.get()
    local text = req and req.raw_body
    local e = text and stream_options_at(text)
    return e ~= nil and byte(text, e + 1) == 123 -- "{"
end

-- The body text with include_usage asked, or nil, err. `so`: the decoded
-- stream_options of the body (nil when it has none).
function _M.with_usage(text, so)
    if type(text) ~= "string" then
        return nil, "no body text"
    end
    local open = find(text, "{", 1, true)
    if not open then
        return nil, "body is not an object"
    end
    if so == nil then
        return sub(text, 1, open) .. USAGE_MEMBER .. sub(text, open + 1)
    end
    local e, err = stream_options_at(text)
    if not e then
        return nil, err
    end
    local vs, ve
    if byte(text, e + 1) == 123 then -- "{"
        vs, ve = find(text, "^%b{}", e + 1)
        if not vs or type(cjson.decode(sub(text, vs, ve))) ~= "table" then
            return nil, "stream_options is not an object without braces in its strings"
        end
    else
        vs, ve = find(text, "^[%w%.%+%-]+", e + 1)
        if not vs then
            return nil, "stream_options is not a scalar or object"
        end
    end
    local value = '{"include_usage":true}'
    if type(so) == "table" then
        local copy = setmetatable({}, replay.OBJECT_MT)
        for k, v in pairs(so) do
            copy[k] = v
        end
        copy.include_usage = true
        local enc = replay.encode(copy)
        if not enc then
            return nil, "stream_options cannot be encoded"
        end
        value = enc
    end
    return sub(text, 1, vs - 1) .. value .. sub(text, ve + 1)
end

local function ask_usage(req, c)
    local body, err = _M.with_usage(req.raw_body, req.body.stream_options)
    if not body then
        log(DEBUG, "infergate: cache: stream usage not asked of the node: ", err)
        return
    end
    ngx.req.set_body_data(body)
    c.usage_added = true
end

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
            ask_usage(req, c)
        end
    end
    return e
end
_M.step = step

-- Takes the cache options from the validated edge options (infergate.core.config,
-- checked there against the rendered spec: every default and range lives in the
-- [cache] section of controlplane/config.py) and, when enabled, hands the exact lookup
-- to the rate-limit script (the access step itself is listed in infergate.phases).
-- Returns true or nil, err.
function _M.init()
    local ok, o = pcall(config.get)
    if not ok then
        return nil, o
    end
    opts = o.cache
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

-- ------------------------------------------------------------------ request checks

-- The Cache-Control header of the request, lower case ("" when absent); nginx joins
-- repeated Cache-Control lines with ",". Read as a variable: no table of every header.
local function cache_control()
    local v = ngx_var("http_cache_control")
    return type(v) == "string" and v:lower() or ""
end

local function has_token(h, token)
    for part in h:gmatch("[^,]+") do
        if part:match("^%s*(.-)%s*$") == token then
            return true
        end
    end
    return false
end

local function media_part(messages)
    if type(messages) ~= "table" then
        return false
    end
    for _, m in ipairs(messages) do
        if type(m) == "table" and type(m.content) == "table" then
            for _, p in ipairs(m.content) do
                if type(p) == "table" and p.type ~= "text" then
                    return true
                end
            end
        end
        if type(m) == "table" and m.audio ~= nil and m.audio ~= null then
            return true
        end
    end
    return false
end

local function given(v)
    return v ~= nil and v ~= null
end

local function positive_int(v)
    return type(v) == "number" and v >= 1 and v == floor(v)
end

-- Reason a request's parameters are ones a node may refuse (a type or range the OpenAI
-- API does not accept), or nil. Such a request goes to a node, which answers it as it
-- does, so its answer is the same whatever the cache holds: the cache leaves out of
-- the key the fields checked here (stream, stream_options) or would serve an answer
-- stored for another value.
local function bad_params(body)
    local st = body.stream
    if given(st) and type(st) ~= "boolean" then
        return "stream is not a boolean"
    end
    local so = body.stream_options
    if given(so) and (type(so) ~= "table" or not options_object(so)) then
        return "stream_options is not an object"
    end
    if given(so) and st ~= true then
        -- vLLM: "Stream options can only be defined when stream=True" (400)
        return "stream_options without stream"
    end
    local temp = body.temperature
    if given(temp) and (type(temp) ~= "number" or temp < 0 or temp > 2) then
        return "temperature out of range"
    end
    local top_p = body.top_p
    if given(top_p) and (type(top_p) ~= "number" or top_p <= 0 or top_p > 1) then
        return "top_p out of range"
    end
    for _, f in ipairs({ "n", "max_tokens", "max_completion_tokens" }) do
        if given(body[f]) and not positive_int(body[f]) then
            return f .. " is not a positive integer"
        end
    end
    return nil
end
_M.bad_params = bad_params

-- Reason the request may not use the cache at all, or nil.
function _M.uncacheable(body)
    local bad = bad_params(body)
    if bad then
        return bad
    end
    if given(body.n) and body.n > 1 then             -- a positive integer (bad_params)
        return "n > 1"
    end
    local lp = body.logprobs
    if lp ~= nil and lp ~= null and lp ~= false then
        return "logprobs"
    end
    local temp = body.temperature                   -- a number when given (bad_params)
    if not given(temp) then
        temp = 1.0
    end
    if temp > opts.max_temperature then
        return "temperature above " .. opts.max_temperature
    end
    if media_part(body.messages) then
        return "non-text content"
    end
    if body.modalities ~= nil and body.modalities ~= null then
        return "modalities"
    end
    return nil
end

local function cut_utf8(s, n)
    if #s <= n then
        return s
    end
    local i = n
    while i > 0 do
        local b = byte(s, i + 1)
        if b < 0x80 or b >= 0xC0 then
            break
        end
        i = i - 1
    end
    return sub(s, 1, i)
end
_M.cut_utf8 = cut_utf8

local function threshold(c)
    local m = c.model and opts.min_similarity_models[c.model]
    if m then
        return m
    end
    local r = opts.min_similarity_routes[c.path]
    if r then
        return r
    end
    return opts.min_similarity or nil
end

-- ------------------------------------------------------------------ Redis

-- When this worker last logged a skipped semantic lookup (at most one line every
-- LOG_EVERY_S: a busy embedder fails some lookups of every burst).
local last_skip_log = -math.huge

-- The usable entry in a raw GET reply (a string or ngx.null) for the request's cache
-- state `c`, or nil (absent or unusable): {doc, tail} for a non-streaming request when
-- the entry has "tail" (infergate.cache.replay.splice), {doc, sse} for a stream whose
-- replay this worker already rendered, else {doc, comp (the decoded stored form),
-- sse (streams)}. An entry stored without usage (a stream whose node ignored the
-- include_usage the edge asked for, cache.stream_usage off, or an older entry) cannot
-- answer a request whose answer must carry usage (a non-streaming one, or a stream with
-- stream_options.include_usage), which then goes to a node and stores a complete entry
-- in its place.
local function decode_entry(raw)
    if raw == null or type(raw) ~= "string" then
        return nil
    end
    local doc = cjson.decode(raw)
    if type(doc) ~= "table" or type(doc.body) ~= "string" then
        return nil
    end
    return doc
end

local function parse_doc(doc, c)
    -- a non-streaming answer from the stored bytes (replay.splice), nothing decoded
    if not c.stream and type(doc.tail) == "string" and type(doc.usage) == "boolean" then
        if not doc.usage then
            return nil
        end
        return { doc = doc, tail = doc.tail }
    end
    -- a stream: the replay rendered for an earlier hit of the same stored body
    if c.stream then
        local tpl = replay.sse_cached(doc.body, c.kind, c.include_usage)
        if tpl then
            return { doc = doc, sse = tpl }
        end
    end
    local comp = replay.decode_stored(doc.body, c.kind)
    if not comp then
        return nil
    end
    if type(comp.usage) ~= "table" and (not c.stream or c.include_usage) then
        return nil
    end
    if c.stream then
        return { doc = doc, comp = comp,
                 sse = replay.sse_template(doc.body, comp, c.kind, c.include_usage) }
    end
    return { doc = doc, comp = comp }
end

local function parse_entry(raw, c)
    local doc = decode_entry(raw)
    return doc and parse_doc(doc, c)
end
_M.parse_entry = parse_entry

-- Worker-local copies of entries read from Redis lately (cache.local_ttl_ms, 0 = none):
-- exact key hex -> {doc = the decoded entry (never changed once decoded), exp = epoch s,
-- never past the entry's expiry}. Repeats of a hot entry are answered without a Redis
-- round trip and without decoding it again; a purged or flagged entry may answer from a
-- worker's copy until that copy expires.
-- Bounded by HOT_MAX_ENTRIES and HOT_MAX_BYTES (of the stored texts): full, it starts
-- over empty.
_M.HOT_MAX_ENTRIES = 1000
_M.HOT_MAX_BYTES = 16 * 1024 * 1024
local hot, hot_count, hot_bytes = {}, 0, 0

local function hot_doc(key, now)
    local h = hot[key]
    if not h then
        return nil
    end
    if h.exp > now then
        return h.doc
    end
    hot[key] = nil
    hot_count = hot_count - 1
    hot_bytes = hot_bytes - h.size
    return nil
end

local function hot_put(key, doc, size, now)
    local ttl = (opts.local_ttl_ms or 0) / 1000
    if ttl <= 0 or size > _M.HOT_MAX_BYTES then
        return
    end
    local old = hot[key]
    if old then
        hot_count = hot_count - 1
        hot_bytes = hot_bytes - old.size
    end
    if hot_count >= _M.HOT_MAX_ENTRIES or hot_bytes + size > _M.HOT_MAX_BYTES then
        hot, hot_count, hot_bytes = {}, 0, 0
    end
    -- never past the entry's own expiry in Redis (stored at "created", for "ttl" s)
    local exp = now + ttl
    local created, life = tonumber(doc.created), tonumber(doc.ttl)
    if created and life and created + life < exp then
        exp = created + life
    end
    hot[key] = { doc = doc, exp = exp, size = size }
    hot_count = hot_count + 1
    hot_bytes = hot_bytes + size
end

-- The usable entry of `key` from a raw GET reply, kept as a worker-local copy.
local function entry_of(raw, key, c)
    local doc = decode_entry(raw)
    if not doc then
        return nil
    end
    hot_put(key, doc, #raw, ngx_now())
    return parse_doc(doc, c)
end

-- The entry of `key` read with client rc: see parse_entry, or nil, err (transport
-- error) or false, err (Redis error reply).
local function get_entry(rc, key, c)
    local raw, err = rc:command("GET", keynames.cache_entry(key))
    if not raw then
        return raw, err
    end
    return entry_of(raw, key, c)
end

-- fn(client, a, b) on a pooled connection (infergate.redis.pool: skipped while Redis is
-- backed off after a failure). Returns fn's result, or nil, err when Redis failed or
-- answered an error. Arguments instead of a closure: a function created per request
-- keeps LuaJIT from compiling the path.
local function with_redis(fn, a, b)
    local res, err = pool.run_with(fn, a, b)
    if res == false or err then
        return nil, err or "redis error"
    end
    return res
end

-- ------------------------------------------------------------------ lookup steps

-- Queues a semantic hit for the control plane's verification (flush queue; see the
-- header). The request body as received, else re-encoded.
local function queue_verify(req, c, key, ns)
    local body = req.raw_body
    if not body and type(req.body) == "table" then
        body = replay.encode(req.body)
    end
    if type(body) ~= "string" or #body > _M.VERIFY_MAX_BODY_BYTES then
        return false
    end
    local item = replay.encode({ key = key, namespace = ns, path = c.path,
                                 model = c.model or "", tenant = c.tenant or "default",
                                 body = body, ts = ngx_now() })
    if not item then
        return false
    end
    local q = keynames.cache_verify_queue
    return flush.push("cache_verify", {
        { "RPUSH", q, item },
        -- bounded while no control plane takes items: the newest are kept
        { "LTRIM", q, -opts.verify_queue_max, -1 },
        { "EXPIRE", q, _M.VERIFY_QUEUE_TTL_S },
    })
end
_M._queue_verify = queue_verify

local random = math.random

local function serve(req, c, entry, match, similarity, key)
    c.status = "HIT"
    c.match = match
    c.similarity = similarity
    key = key or c.key
    c.entry_key = key
    ngx.header[_M.ENTRY_HEADER] = key
    local ns = entry.doc.namespace
    if type(ns) ~= "string" or ns == "" then
        ns = c.namespace
    end
    if type(ns) == "string" and ns ~= "" then
        local h = keynames.cache_ns_stats(ns)
        flush.count(h, match == "semantic" and "hits_semantic" or "hits_exact", 1,
            _M.NS_STATS_TTL_S)
        local f = opts.verify_fraction or 0
        if match == "semantic" and f > 0 and (f >= 1 or random() < f)
            and queue_verify(req, c, key, ns) then
            flush.count(h, "verify_queued", 1, _M.NS_STATS_TTL_S)
        end
    end
    return replay.send(req, c, entry.comp, tonumber(entry.doc.created), match, similarity,
        entry.tail, entry.sse)
end

-- The entry to serve for a semantic hit: a hit answers another prompt, so an answer that
-- shows usage (non-streaming, or a stream with include_usage) reports prompt_tokens
-- estimated from the stored ones and the two prompts' lengths (replay.scaled_usage;
-- the entry's "prompt_chars"). Entries without prompt_chars keep their figures.
local function semantic_usage(req, c, entry)
    if c.stream and not c.include_usage then
        return entry
    end
    local stored = tonumber(entry.doc.prompt_chars)
    if not stored or stored <= 0 then
        return entry
    end
    local comp = entry.comp or replay.decode_stored(entry.doc.body, c.kind)
    if not comp then
        return entry
    end
    local u = replay.scaled_usage(comp.usage, reqctx.prompt_chars(req), stored)
    if not u then
        return entry
    end
    comp.usage = u
    return { doc = entry.doc, comp = comp }
end
_M._semantic_usage = semantic_usage

-- Value of a coalescing lock once its leader ended without storing an answer
-- (infergate.cache.capture): waiters and identical requests go to a node at once.
_M.NOSTORE = "nostore"

local function wait_for_leader(c, lock)
    local dict = ngx.shared[_M.DICT]
    local deadline = ngx_now() + opts.coalesce_wait_s
    local pause = opts.coalesce_poll_ms / 1000
    -- The leader releases the lock once its answer is stored, or marks it NOSTORE the
    -- moment it ends without one: poll the shared dict, and read Redis only then.
    while true do
        ngx.sleep(pause)
        local v = dict:get(lock)
        if v == _M.NOSTORE then
            return nil
        end
        if not v then
            local entry = with_redis(get_entry, c.key, c)
            return entry
        end
        ngx.update_time()
        if ngx_now() >= deadline then
            return nil
        end
    end
end

-- Embedder circuit breaker (see the header), shared by the workers in _M.DICT:
-- "emb:fails" failed lookup calls in a row, "emb:open" present while open (its TTL the
-- cooldown), "emb:ok_at" when a lookup call last succeeded. A call that timed out within
-- EMBEDDER_BUSY_S of a success is a busy embedder (a burst queued behind the model),
-- not a hung one: it is a BYPASS but does not count toward opening the breaker, so
-- a burst does not turn the semantic cache off for the cooldown after it.
_M.EMBEDDER_BREAKER_FAILURES = 5
_M.EMBEDDER_COOLDOWN_S = 5
_M.EMBEDDER_BUSY_S = 1

local function embedder_open()
    local dict = ngx.shared[_M.DICT]
    return dict ~= nil and dict:get("emb:open") ~= nil
end

local function embedder_result(ok, why)
    local dict = ngx.shared[_M.DICT]
    if not dict then
        return
    end
    if ok then
        dict:set("emb:ok_at", ngx_now())
        local before = dict:get("emb:fails") or 0
        if before ~= 0 then
            dict:set("emb:fails", 0)
            if before >= _M.EMBEDDER_BREAKER_FAILURES then
                log(WARN, "infergate: the embedder answers lookups again")
            end
        end
        return
    end
    local fails = dict:incr("emb:fails", 1, 0)
    if fails and fails >= _M.EMBEDDER_BREAKER_FAILURES and dict:get("emb:open") == nil then
        dict:set("emb:open", ngx_now(), _M.EMBEDDER_COOLDOWN_S)
        if fails == _M.EMBEDDER_BREAKER_FAILURES then
            log(WARN, "infergate: ", fails, " semantic lookups in a row failed (", why,
                "): lookups skipped for ", _M.EMBEDDER_COOLDOWN_S, " s at a time until the ",
                "embedder answers again")
        end
    end
end

local function embedder_busy()
    local dict = ngx.shared[_M.DICT]
    local ok_at = dict and dict:get("emb:ok_at")
    return ok_at ~= nil and ngx_now() - ok_at < _M.EMBEDDER_BUSY_S
end

-- One call of the embedder's POST /v1/lookups for `items` (lookup bodies), through the
-- internal location: the list of answers, or nil, err. Feeds the breaker: one outcome per
-- call.
local function send_lookups(items)
    prometheus.semantic_call(#items)
    local body = replay.encode({ lookups = items, brief = true })
    local res = ngx.location.capture(_M.LOOKUP_LOCATION, { method = ngx.HTTP_POST, body = body })
    if not res then
        embedder_result(false, "subrequest failed")
        return nil, "embedder subrequest failed"
    end
    -- a timeout (504, or an answer cut while it was being read) soon after a lookup that
    -- succeeded: the embedder is busy, not hung
    local timed_out = res.status == ngx.HTTP_GATEWAY_TIMEOUT or res.truncated
    if timed_out and embedder_busy() then
        return nil, "embedder busy (lookup timed out)"
    end
    if res.status ~= 200 then
        if res.status >= 500 then
            embedder_result(false, "answered " .. tostring(res.status))
        end
        return nil, "embedder answered " .. tostring(res.status)
    end
    if res.truncated then
        embedder_result(false, "answer truncated")
        return nil, "embedder answer truncated"
    end
    local doc = cjson.decode(res.body or "")
    local results = type(doc) == "table" and doc.results
    if type(results) ~= "table" then
        embedder_result(false, "answer not JSON")
        return nil, "embedder answer is not a list of lookup results"
    end
    embedder_result(true)
    return results
end

-- Semantic lookup through the embedder (grouped with this worker's concurrent lookups by
-- infergate.cache.batch). Returns the lookup answer table or nil, err.
local function semantic_lookup(c)
    -- route and model select the embedder's per-domain thresholds
    local payload = { namespace = c.namespace, text = cut_utf8(c.text, _M.MAX_TEXT_BYTES),
                      route = c.path, model = cut_utf8(c.model or "", 256) }
    local th = threshold(c)
    if th then
        payload.min_similarity = th
    end
    local res, err = batch.submit(payload, (opts.semantic_budget_ms or 150) / 1000,
                                  send_lookups)
    if res == nil then
        if err == "timeout" then
            -- waited for this worker's earlier lookups past the budget: busy, not down
            prometheus.semantic_lookup("busy")
            return nil, "embedder busy (lookup queued past the budget)"
        end
        prometheus.semantic_lookup(find(err or "", "busy", 1, true) and "busy" or "error")
        return nil, err
    end
    if type(res) ~= "table" or type(res.error) == "table" then
        prometheus.semantic_lookup("error")
        if type(res) ~= "table" then
            return nil, "embedder answer for the lookup is not an object"
        end
        local m = res.error.message
        return nil, "embedder refused the lookup: " .. (type(m) == "string" and m or "?")
    end
    return res
end

local function bypass(c, reason, store)
    c.status = "BYPASS"
    c.reason = reason
    c.store = store and true or false
end

-- The request's cache state (req.cache once the cache step runs) and its keys, worked
-- out once per request before any Redis call: returns c, k (k = nil when the request
-- bypasses the cache or takes no part in it; c = nil when it is not a cacheable route).
local function prepare(req)
    if req.cache_prepared then
        return req.cache_state, req.cache_keys
    end
    req.cache_prepared = true
    if not opts or not opts.enabled or req.route ~= "inference" then
        return nil
    end
    local path = ngx_var("uri")
    local kind = _M.PATHS[path]
    local body = req.body
    if not kind or type(body) ~= "table" then
        return nil
    end
    local c = {
        path = path, kind = kind, status = "BYPASS", store = false,
        stream = req.stream == true, include_usage = req.include_usage == true,
        ttl = opts.ttl_s, max_bytes = opts.max_entry_bytes, dict = _M.DICT,
        model = req.model or "",
    }
    -- req.cache (counted and captured) only once the cache step runs: a request refused
    -- by the rate limit before it took no part in the cache
    req.cache_state = c
    local cc = cache_control()
    if has_token(cc, "no-store") then
        bypass(c, "no-store", false)
        return c
    end
    if (req.body_bytes or 0) > opts.max_request_bytes then
        bypass(c, "body over cache.max_request_bytes", false)
        return c
    end
    local why = _M.uncacheable(body)
    if why then
        bypass(c, why, false)
        return c
    end
    local tenant = req.tenant
    if type(tenant) ~= "string" or tenant == "" then
        tenant = "default"
    end
    c.tenant = tenant
    -- the namespace key only for semantic lookups; without them a stored answer works
    -- it out when it is stored (capture.lua, for the namespace index): a hit never pays
    -- for it
    local k, kerr = cachekey.keys_for(req.raw_body, path, body, tenant, not opts.semantic)
    if not k then
        bypass(c, "key: " .. tostring(kerr), false)
        return c
    end
    -- c.text (the text to embed) only when semantic lookups are on: without it no index
    -- job is queued for an embedder that is not there
    c.key, c.namespace = k.exact, k.namespace
    c.text = opts.semantic and k.text or nil
    if not opts.semantic then
        c.body = body
    end
    if has_token(cc, "no-cache") then
        bypass(c, "no-cache", true)
        return c
    end
    req.cache_keys = k
    return c, k
end

-- For the rate-limit step (infergate.admission.ratelimit.companion): the exact lookup's
-- GET, sent in the pipeline of the rate-limit script, and the callback that keeps its
-- reply for the cache step. nil when the request does no exact lookup.
function _M.prefetch(req)
    local c, k = prepare(req)
    if not k or hot_doc(k.exact, ngx_now()) then
        return nil -- no lookup, or this worker holds the entry
    end
    return { "GET", keynames.cache_entry(k.exact) }, function(reply)
        c.prefetched = reply
    end
end

local last_down_log = -math.huge
local last_foreign_log = -math.huge

-- The access step. Returns nil (go on) or ends the request with a cached answer.
function _M.lookup(req)
    local c, k = prepare(req)
    req.cache = c
    if not k then
        return nil
    end

    -- exact: this worker's copy, the reply fetched with the rate-limit script, or a GET
    -- of its own
    local entry, err
    local pre = c.prefetched
    local doc = hot_doc(k.exact, ngx_now())
    if doc then
        entry = parse_doc(doc, c)
    elseif pre ~= nil and pre ~= false and redis.error_of(pre) == nil then
        entry = entry_of(pre, k.exact, c)
    else
        entry, err = with_redis(get_entry, k.exact, c)
    end
    if err then
        -- at most one line every LOG_EVERY_S per worker: a saturated worker whose Redis
        -- reads time out now and then must not flood the error log
        local now = ngx_now()
        if now - last_down_log >= _M.LOG_EVERY_S then
            log(WARN, "infergate: cache lookup skipped, Redis unavailable: ", err)
            last_down_log = now
        end
        return bypass(c, "redis", false)
    end
    if entry then
        return serve(req, c, entry, "exact", 1)
    end

    -- coalescing
    if opts.coalesce and opts.coalesce_wait_s > 0 then
        local dict = ngx.shared[_M.DICT]
        local lock = "lock:" .. k.exact
        local owner = req.id or tostring(ngx_now())
        local ok = dict and dict:add(lock, owner, opts.coalesce_wait_s)
        if ok then
            c.lock, c.owner = lock, owner
        elseif dict and dict:get(lock) ~= _M.NOSTORE then
            entry = wait_for_leader(c, lock)
            if entry then
                return serve(req, c, entry, "exact", 1)
            end
        end
    end

    -- semantic
    if opts.semantic and k.namespace and embedder_open() then
        prometheus.semantic_lookup("breaker_open")
        return bypass(c, "embedder_breaker_open", true)
    end
    if opts.semantic and k.namespace then
        local res, serr = semantic_lookup(c)
        if not res then
            local now = ngx_now()
            if now - last_skip_log >= _M.LOG_EVERY_S then
                log(WARN, "infergate: semantic cache lookup skipped: ", serr)
                last_skip_log = now
            end
            return bypass(c, serr, true)
        end
        if res.hit == true and type(res.key) == "string" and res.key:find("^%x+$") then
            local hit, herr
            local hdoc = hot_doc(res.key, ngx_now())
            if hdoc then
                hit = parse_doc(hdoc, c)
            else
                hit, herr = with_redis(get_entry, res.key, c)
            end
            -- only an entry stored for this request's namespace (same tenant, route, model
            -- and context): an embedder that answers with another partition's key (a
            -- wrong or foreign process on its address) never leaks that answer
            if hit and (hit.doc.namespace ~= c.namespace or hit.doc.tenant ~= c.tenant) then
                local now = ngx_now()
                if now - last_foreign_log >= _M.LOG_EVERY_S then
                    log(WARN, "infergate: semantic hit from the embedder ignored: the entry ",
                        "belongs to another namespace")
                    last_foreign_log = now
                end
                hit = nil
            end
            if hit then
                prometheus.semantic_lookup("hit")
                hit = semantic_usage(req, c, hit)
                return serve(req, c, hit, "semantic", tonumber(res.similarity) or 0, res.key)
            end
            if herr then
                prometheus.semantic_lookup("miss")
                return bypass(c, "redis", false)
            end
        end
        prometheus.semantic_lookup("miss")
    end
    c.status = "MISS"
    c.store = true
    return nil
end

return _M
