-- Response cache lookup in the access phase (exact in Redis, then semantic through the
-- embedder), request coalescing, and serving hits.
--
--   init_by_lua:  assert(require("infergate.cache.lookup").init([[{...options...}]]))
--
-- init() validates the options rendered from the [cache] section of infergate.toml and
-- adds the "cache" step to the access pipeline (infergate.access) before the first of
-- "eligible" and "admission", so hits are answered after auth and rate limits but
-- without any node and regardless of node saturation.
--
-- The step, for POST /v1/chat/completions and /v1/completions with a JSON body:
--   * BYPASS (neither read nor stored): Cache-Control: no-store; content parts other
--     than text (image, audio, file); n > 1; logprobs asked (token positions cannot be
--     replayed); temperature above max_temperature (absent = 1.0, the API default).
--   * Cache-Control: no-cache: not read, the fresh answer is stored (BYPASS).
--   * exact: GET infergate:v1:cache:entry:<key>; Redis down -> BYPASS, nothing stored
--     (after a failed call the worker skips Redis for REDIS_RETRY_S = 1 s).
--   * coalescing: on an exact miss the first request takes a lock in the shared dict
--     (add with TTL coalesce_wait_s); identical requests arriving meanwhile poll the entry
--     every coalesce_poll_ms and serve it as an exact HIT when it appears, or go on when
--     the lock is gone or coalesce_wait_s passed.
--   * semantic (when the request has a namespace): subrequest to the internal location
--     /_infergate/cache/lookup (proxy_pass to the embedder's POST /v1/lookup, timeouts =
--     semantic_budget_ms); any failure or timeout -> BYPASS (the answer is still stored).
--     A hit whose entry is gone (expired, purged) is a miss.
--   * miss -> MISS, the node's answer is captured (infergate.cache.capture).
-- The request's cache state is req.cache (see capture.lua for the fields it reads).
local cjson = require("cjson.safe")
local config = require("infergate.core.config")
local keynames = require("infergate.redis.keynames")
local redis = require("infergate.redis.client")
local cachekey = require("infergate.cache.key")
local replay = require("infergate.cache.replay")

local _M = {}

local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local byte = string.byte
local sub = string.sub
local null = cjson.null
local log = ngx.log
local WARN = ngx.WARN
local ERR = ngx.ERR

_M.DICT = "infergate_cache"
_M.LOOKUP_LOCATION = "/_infergate/cache/lookup"
_M.PATHS = { ["/v1/chat/completions"] = "chat", ["/v1/completions"] = "text" }
--- Longest last-user text sent to the embedder (bytes, cut on a character boundary).
_M.MAX_TEXT_BYTES = 16384

local DEFAULTS = {
    enabled = true,
    ttl_s = 3600,
    max_entry_bytes = 262144,
    max_temperature = 1.0,
    semantic = true,
    semantic_budget_ms = 150,
    min_similarity = false,   -- false = the embedder's default
    min_similarity_routes = {},
    min_similarity_models = {},
    coalesce = true,
    coalesce_wait_s = 10.0,
    coalesce_poll_ms = 50,
}

local RANGES = {
    ttl_s = { 1, 366 * 24 * 3600 },
    max_entry_bytes = { 1024, 64 * 1024 * 1024 },
    max_temperature = { 0, 2 },
    semantic_budget_ms = { 1, 10000 },
    coalesce_wait_s = { 0, 600 },
    coalesce_poll_ms = { 5, 5000 },
}

local opts = nil

local function check_similarities(name, t)
    if type(t) ~= "table" then
        return nil, "cache option '" .. name .. "' must be an object"
    end
    for k, v in pairs(t) do
        if type(k) ~= "string" or type(v) ~= "number" or v < 0 or v > 1 then
            return nil, "cache option '" .. name .. "': values must be numbers from 0 to 1"
        end
    end
    return true
end

local function step(req)
    return _M.lookup(req)
end

-- Validates the options (JSON text or table) and installs the access step.
-- Returns true or nil, err.
function _M.init(src)
    local t, o = config.decode_options(src, DEFAULTS, "cache options")
    if not t then
        return nil, o
    end
    for k, v in pairs(t) do
        if DEFAULTS[k] == nil then
            return nil, "unknown cache option '" .. tostring(k) .. "'"
        end
        if k == "min_similarity" then
            if v ~= false and v ~= null and (type(v) ~= "number" or v < 0 or v > 1) then
                return nil, "cache option 'min_similarity' must be a number from 0 to 1"
            end
            o[k] = (v == null) and false or v
        elseif k == "min_similarity_routes" or k == "min_similarity_models" then
            local ok, err = check_similarities(k, v)
            if not ok then
                return nil, err
            end
            o[k] = v
        else
            if type(v) ~= type(DEFAULTS[k]) then
                return nil, "cache option '" .. k .. "' must be a " .. type(DEFAULTS[k])
            end
            local r = RANGES[k]
            if r and (v < r[1] or v > r[2]) then
                return nil, "cache option '" .. k .. "' out of range: " .. tostring(v)
            end
            o[k] = v
        end
    end
    opts = o
    if o.enabled and not _M.installed then
        local access = require("infergate.access")
        local before = "eligible"
        for _, s in ipairs(access.steps) do
            if s.name == "eligible" or s.name == "admission" then
                before = s.name
                break
            end
        end
        access.insert_step("cache", step, before)
        _M.installed = true
    end
    return true
end

function _M.options()
    return opts
end

-- ------------------------------------------------------------------ request checks

local function header_tokens(name)
    local v = ngx.req.get_headers()[name]
    if type(v) == "table" then
        v = table.concat(v, ",")
    end
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

-- Reason the request may not use the cache at all, or nil.
function _M.uncacheable(body)
    local n = body.n
    if n ~= nil and n ~= null and (type(n) ~= "number" or n > 1) then
        return "n > 1"
    end
    local lp = body.logprobs
    if lp ~= nil and lp ~= null and lp ~= false then
        return "logprobs"
    end
    local temp = body.temperature
    if temp == nil or temp == null then
        temp = 1.0
    end
    if type(temp) ~= "number" or temp > opts.max_temperature then
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

local redis_conf, redis_conf_err
local redis_down_logged = false
local embedder_down_logged = false

-- after a failed Redis call the worker skips Redis for this long (s): a Redis that
-- drops packets would otherwise cost every request the full timeout
_M.REDIS_RETRY_S = 1.0
local redis_down_until = 0

local function redis_connect()
    if ngx.now() < redis_down_until then
        return nil, "redis unavailable (retrying in under " .. _M.REDIS_RETRY_S .. " s)"
    end
    if not redis_conf and not redis_conf_err then
        redis_conf, redis_conf_err = redis.parse_url(config.get().redis_url)
    end
    if not redis_conf then
        return nil, redis_conf_err
    end
    return redis.connect(redis_conf, config.get().redis_timeout_ms)
end

-- The stored entry of `key` for the request's cache state `c`: {doc, comp} or nil
-- (absent or unusable), or nil, err. An entry stored from a stream that did not ask
-- for usage has none: it cannot answer a request whose answer must carry usage (a
-- non-streaming one, or a stream with stream_options.include_usage), which then goes
-- to a node and stores a complete entry in its place.
local function get_entry(rc, key, c)
    local kind = c.kind
    local raw, err = rc:command("GET", keynames.cache_entry(key))
    if raw == nil then
        return nil, err
    end
    if raw == null or type(raw) ~= "string" then
        return nil
    end
    local doc = cjson.decode(raw)
    if type(doc) ~= "table" or type(doc.body) ~= "string" then
        return nil
    end
    local comp = replay.decode_stored(doc.body, kind)
    if not comp then
        return nil
    end
    if type(comp.usage) ~= "table" and (not c.stream or c.include_usage) then
        return nil
    end
    return { doc = doc, comp = comp }
end

local function with_redis(fn)
    local rc, err = redis_connect()
    if not rc then
        if ngx.now() >= redis_down_until then
            redis_down_until = ngx.now() + _M.REDIS_RETRY_S
        end
        return nil, err
    end
    local res, ferr = fn(rc)
    if ferr then
        rc:close()
        redis_down_until = ngx.now() + _M.REDIS_RETRY_S
        return nil, ferr
    end
    rc:keepalive()
    return res
end

-- ------------------------------------------------------------------ lookup steps

local function serve(req, c, entry, match, similarity)
    c.status = "HIT"
    c.match = match
    c.similarity = similarity
    return replay.send(req, c, entry.comp, tonumber(entry.doc.created), match, similarity)
end

local function wait_for_leader(c, lock)
    local dict = ngx.shared[_M.DICT]
    local deadline = ngx.now() + opts.coalesce_wait_s
    local pause = opts.coalesce_poll_ms / 1000
    -- The leader releases the lock once its answer is stored (or it gave up): poll the
    -- shared dict, and read Redis only then.
    while true do
        ngx.sleep(pause)
        if not dict:get(lock) then
            local entry = with_redis(function(rc)
                return get_entry(rc, c.key, c)
            end)
            return entry
        end
        ngx.update_time()
        if ngx.now() >= deadline then
            return nil
        end
    end
end

-- Semantic lookup through the embedder. Returns the lookup answer table or nil, err.
local function semantic_lookup(c)
    local payload = { namespace = c.namespace, text = cut_utf8(c.text, _M.MAX_TEXT_BYTES) }
    local th = threshold(c)
    if th then
        payload.min_similarity = th
    end
    local body = replay.encode(payload)
    local res = ngx.location.capture(_M.LOOKUP_LOCATION, { method = ngx.HTTP_POST, body = body })
    if not res then
        return nil, "embedder subrequest failed"
    end
    if res.status ~= 200 then
        return nil, "embedder answered " .. tostring(res.status)
    end
    if res.truncated then
        return nil, "embedder answer truncated"
    end
    local doc = cjson.decode(res.body or "")
    if type(doc) ~= "table" then
        return nil, "embedder answer is not JSON"
    end
    return doc
end

local function bypass(c, reason, store)
    c.status = "BYPASS"
    c.reason = reason
    c.store = store and true or false
end

-- The access step. Returns nil (go on) or ends the request with a cached answer.
function _M.lookup(req)
    if not opts or not opts.enabled or req.route ~= "inference" then
        return nil
    end
    local path = ngx.var.uri
    local kind = _M.PATHS[path]
    local body = req.body
    if not kind or type(body) ~= "table" then
        return nil
    end
    local c = {
        path = path, kind = kind, status = "BYPASS", store = false,
        stream = body.stream == true,
        include_usage = type(body.stream_options) == "table"
            and body.stream_options.include_usage == true,
        ttl = opts.ttl_s, max_bytes = opts.max_entry_bytes, dict = _M.DICT,
        model = type(body.model) == "string" and body.model or "",
    }
    req.cache = c
    local cc = header_tokens("cache-control")
    if has_token(cc, "no-store") then
        return bypass(c, "no-store", false)
    end
    local why = _M.uncacheable(body)
    if why then
        return bypass(c, why, false)
    end
    local tenant = req.tenant
    if type(tenant) ~= "string" or tenant == "" then
        tenant = "default"
    end
    c.tenant = tenant
    local k, kerr = cachekey.keys(path, body, tenant)
    if not k then
        return bypass(c, "key: " .. tostring(kerr), false)
    end
    -- c.text (the text to embed) only when semantic lookups are on: without it no index
    -- job is queued for an embedder that is not there
    c.key, c.namespace = k.exact, k.namespace
    c.text = opts.semantic and k.text or nil
    if has_token(cc, "no-cache") then
        return bypass(c, "no-cache", true)
    end

    -- exact
    local entry, err = with_redis(function(rc)
        return get_entry(rc, k.exact, c)
    end)
    if err then
        if not redis_down_logged then
            log(ERR, "infergate: cache lookup skipped, Redis unavailable: ", err)
            redis_down_logged = true
        end
        return bypass(c, "redis", false)
    end
    redis_down_logged = false
    if entry then
        return serve(req, c, entry, "exact", 1)
    end

    -- coalescing
    if opts.coalesce and opts.coalesce_wait_s > 0 then
        local dict = ngx.shared[_M.DICT]
        local lock = "lock:" .. k.exact
        local owner = req.id or tostring(ngx.now())
        local ok = dict and dict:add(lock, owner, opts.coalesce_wait_s)
        if ok then
            c.lock, c.owner = lock, owner
        elseif dict then
            entry = wait_for_leader(c, lock)
            if entry then
                return serve(req, c, entry, "exact", 1)
            end
        end
    end

    -- semantic
    if opts.semantic and k.namespace then
        local res, serr = semantic_lookup(c)
        if not res then
            if not embedder_down_logged then
                log(WARN, "infergate: semantic cache lookup skipped: ", serr)
                embedder_down_logged = true
            end
            return bypass(c, serr, true)
        end
        embedder_down_logged = false
        if res.hit == true and type(res.key) == "string" and res.key:find("^%x+$") then
            local hit, herr = with_redis(function(rc)
                return get_entry(rc, res.key, c)
            end)
            if hit then
                return serve(req, c, hit, "semantic", tonumber(res.similarity) or 0)
            end
            if herr then
                return bypass(c, "redis", false)
            end
        end
    end
    c.status = "MISS"
    c.store = true
    return nil
end

return _M
