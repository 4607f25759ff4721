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
local ipairs = ipairs
local tonumber = tonumber
local tostring = tostring
local byte = string.byte
local find = string.find
local format = string.format
local concat = table.concat
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
local function semantic_lookup(c, req)
    -- route and model select the embedder's per-domain thresholds
    local payload = { namespace = c.namespace, text = cut_utf8(c.text, shared.MAX_TEXT_BYTES),
                      route = c.path, model = cut_utf8(c.model or "", 256) }
    local th = threshold(c)
    if th then
        payload.min_similarity = th
    end
    local res, err = batch.submit(payload, (opts.semantic_budget_ms or 150) / 1000,
                                  embedder.send_lookups, req)
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

-- "name=0.1234" of a number field of the lookup answer, or nil.
local function figure(name, v)
    v = tonumber(v)
    if not v then
        return nil
    end
    return name .. "=" .. format("%.4f", v)
end

-- The X-Cache-Score value of a hit: the score the embedder's decision compared with its
-- threshold, named ("verifier=0.8123", "rerank=0.9650" or "cosine=0.9712").
local function score_text(res)
    local by = res.decided_by
    if by == "verifier" or by == "rerank" then
        return figure(by, res.verifier_score) or (by .. "=?")
    end
    return figure("cosine", res.similarity) or "cosine=?"
end
_M.score_text = score_text

local function pct(c)
    return format("%%%02X", byte(c))
end

-- The X-Cache-Explain value of a lookup answer: the candidate's cosine, the verifier's
-- score, the two thresholds, the guard's verdict, the deciding score and the model.
local function explain_text(res)
    local parts = {}
    for _, f in ipairs({ { "cosine", res.similarity }, { "verifier", res.verifier_score },
                         { "min_similarity", res.min_similarity },
                         { "min_verifier_score", res.min_verifier_score } }) do
        parts[#parts + 1] = figure(f[1], f[2]) or (f[1] == "cosine" and "cosine=none" or nil)
    end
    -- the guard's reason may quote words of the question (antonym:最高/最低): a header
    -- value keeps to printable ASCII: other bytes, spaces, % and ; percent-encoded as in
    -- a URI
    parts[#parts + 1] = "guard=" .. (type(res.guard) == "string"
        and res.guard:gsub("[^\33-\36\38-\58\60-\126]", pct) or "none")
    parts[#parts + 1] = "decided_by=" .. tostring(res.decided_by or "cosine")
    if type(res.model_id) == "string" then
        -- a header value: printable ASCII only
        parts[#parts + 1] = "model=" .. res.model_id:gsub("[^%w%._:@/-]", "_")
    end
    return concat(parts, "; ")
end
_M.explain_text = explain_text

-- Whether the request asked for the explanation and the options allow it.
local function wants_explain()
    if not opts.explain then
        return false
    end
    local v = ngx.var.http_x_cache_explain
    return v == "1" or v == "true"
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
        local res, serr = semantic_lookup(c, req)
        if not res then
            local now = ngx_now()
            if now - last_skip_log >= shared.LOG_EVERY_S then
                log(WARN, "infergate: semantic cache lookup skipped: ", serr)
                last_skip_log = now
            end
            return true, bypass(c, serr, true)
        end
        if wants_explain() then
            c.explain = explain_text(res)
        end
        if res.hit == true and type(res.key) == "string" and res.key:find("^%x+$") then
            local hit, herr = hit_entry(c, res.key)
            if hit then
                prometheus.semantic_lookup("hit")
                hit = semantic_usage(req, c, hit)
                ngx.header["X-Cache-Score"] = score_text(res)
                if c.explain then
                    ngx.header["X-Cache-Explain"] = c.explain
                end
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
