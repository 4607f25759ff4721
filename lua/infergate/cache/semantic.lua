-- The semantic lookup of a request that missed the exact cache (see
-- infergate.cache.lookup): through the embedder (grouped by infergate.cache.batch,
-- behind the embedder breaker of infergate.cache.embedder), the entry it names read as
-- an exact one, and a hit's usage scaled to the requesting prompt.
local ngx_now = require("infergate.core.ngxapi").now
local replay = require("infergate.cache.replay")
local batch = require("infergate.cache.batch")
local prometheus = require("infergate.core.prometheus")
local reqctx = require("infergate.core.reqctx")
local shared = require("infergate.cache.shared")
local embedder = require("infergate.cache.embedder")
local entries = require("infergate.cache.entry")
local hotcache = require("infergate.cache.hotcache")
local policy = require("infergate.cache.policy")
local serve = require("infergate.cache.serve")

local _M = {}

local type = type
local tonumber = tonumber
local find = string.find
local cut_utf8 = shared.cut_utf8
local with_redis = shared.with_redis
local bypass = policy.bypass
local log = ngx.log
local WARN = ngx.WARN

local opts = nil

-- The [cache] options (infergate.cache.lookup.init).
function _M.configure(o)
    opts = o
end

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

-- When this worker last logged a skipped semantic lookup (at most one line every
-- LOG_EVERY_S: a busy embedder fails some lookups of every burst).
local last_skip_log = -math.huge

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
_M.semantic_usage = semantic_usage

-- Semantic lookup through the embedder (grouped with this worker's concurrent lookups by
-- infergate.cache.batch). Returns the lookup answer table or nil, err.
local function semantic_lookup(c)
    -- route and model select the embedder's per-domain thresholds
    local payload = { namespace = c.namespace, text = cut_utf8(c.text, shared.MAX_TEXT_BYTES),
                      route = c.path, model = cut_utf8(c.model or "", 256) }
    local th = threshold(c)
    if th then
        payload.min_similarity = th
    end
    local res, err = batch.submit(payload, (opts.semantic_budget_ms or 150) / 1000,
                                  embedder.send_lookups)
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

local last_foreign_log = -math.huge

-- The entry the embedder's hit names, when it belongs to the request's namespace: hit,
-- or nil, err (Redis failed).
local function hit_entry(c, key)
    local hit, herr
    local hdoc = hotcache.get(key, ngx_now())
    if hdoc then
        hit = entries.parse_doc(hdoc, c)
    else
        hit, herr = with_redis(entries.get_entry, key, c)
    end
    -- only an entry stored for this request's namespace (same tenant, route, model
    -- and context): an embedder that answers with another partition's key (a
    -- wrong or foreign process on its address) never leaks that answer
    if hit and (hit.doc.namespace ~= c.namespace or hit.doc.tenant ~= c.tenant) then
        local now = ngx_now()
        if now - last_foreign_log >= shared.LOG_EVERY_S then
            log(WARN, "infergate: semantic hit from the embedder ignored: the entry ",
                "belongs to another namespace")
            last_foreign_log = now
        end
        hit = nil
    end
    return hit, herr
end

-- The semantic step of the lookup for the request's cache state c and keys k. Returns
-- true, result when it decided the request (a hit served, or a BYPASS; result is what
-- the access step returns), or false when the request goes on as a miss.
function _M.run(req, c, k)
    if opts.semantic and k.namespace and embedder.open() then
        prometheus.semantic_lookup("breaker_open")
        return true, bypass(c, "embedder_breaker_open", true)
    end
    if opts.semantic and k.namespace then
        local res, serr = semantic_lookup(c)
        if not res then
            local now = ngx_now()
            if now - last_skip_log >= shared.LOG_EVERY_S then
                log(WARN, "infergate: semantic cache lookup skipped: ", serr)
                last_skip_log = now
            end
            return true, bypass(c, serr, true)
        end
        if res.hit == true and type(res.key) == "string" and res.key:find("^%x+$") then
            local hit, herr = hit_entry(c, res.key)
            if hit then
                prometheus.semantic_lookup("hit")
                hit = semantic_usage(req, c, hit)
                return true, serve.serve(req, c, hit, "semantic", tonumber(res.similarity) or 0,
                    res.key)
            end
            if herr then
                prometheus.semantic_lookup("miss")
                return true, bypass(c, "redis", false)
            end
        end
        prometheus.semantic_lookup("miss")
    end
    return false
end

return _M
