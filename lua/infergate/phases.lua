-- Every step of every phase of the edge, in order: the one module the rendered nginx
-- configuration calls, once per phase.
--
--   init_by_lua:          require("infergate.phases").init()   -- after infergate.core.config.init
--   init_worker_by_lua:   require("infergate.phases").init_worker()
--   access_by_lua:        require("infergate.phases").access("inference")
--                         -- or "models", "api", "tokenizer", "passthrough"
--                         -- (infergate.access METHODS)
--   balancer_by_lua:      require("infergate.phases").balancer()
--   header_filter_by_lua: require("infergate.phases").header_filter("proxy")  -- or "error"
--   body_filter_by_lua:   require("infergate.phases").body_filter()
--   log_by_lua:           require("infergate.phases").log()
--   content_by_lua:       require("infergate.phases").error_page(502)  -- error locations
--
-- A step is {name, fn, when}: `when` names an option switch (SWITCHES) that must be on
-- for the step to run; the switches are read once from the edge options
-- (infergate.core.config) by init(). Access steps are function(req) -> nil to continue,
-- or an error table {status, message, type, code, headers} answered as OpenAI-style JSON
-- (infergate.core.errors), which ends the request; a step may also end it itself (a cache
-- hit, a slow body sent to the 408 location). Filter and log steps all run, in order.
-- access() creates the request's state (infergate.core.reqctx) before the first step;
-- its body is read and decoded once (steps body_read and body) and every later step
-- reads it from there.
local config = require("infergate.core.config")
local errors = require("infergate.core.errors")
local cors = require("infergate.core.cors")
local reqctx = require("infergate.core.reqctx")
local flush = require("infergate.core.flush")
local knownkeys = require("infergate.admission.knownkeys")
local access = require("infergate.access")
local filters = require("infergate.filters")
local log = require("infergate.log")
local errorpage = require("infergate.errorpage")
local snapshot = require("infergate.routing.snapshot")
local routing_balancer = require("infergate.routing.balancer")
local models = require("infergate.routing.models")
local ctxfit = require("infergate.routing.ctxfit")
local upstream = require("infergate.routing.upstream")
local stall = require("infergate.routing.stall")
local stats = require("infergate.routing.stats")
local liveness = require("infergate.routing.liveness")
local closing = require("infergate.core.closing")
local auth = require("infergate.admission.auth")
local inputguard = require("infergate.admission.inputguard")
local ratelimit = require("infergate.admission.ratelimit")
local shed = require("infergate.admission.shed")
local usage = require("infergate.admission.usage")
local lookup = require("infergate.cache.lookup")
local capture = require("infergate.cache.capture")
local pool = require("infergate.redis.pool")
local relay = require("infergate.stream.relay")

local _M = {}

-- Option switches of the steps: name -> function(options) -> bool.
_M.SWITCHES = {
    cache = function(o)
        return o.cache ~= nil and o.cache.enabled == true
    end,
}

-- access_by_lua of the API locations. Order: method (OPTIONS: a CORS preflight answered
-- here, infergate.core.cors) -> auth (API key -> req.tenant) ->
-- body_read (slow body 408, compressed 415, invalid UTF-8 400) -> body (the JSON object,
-- decoded once; its bounds) -> models (unknown model 404; GET /v1/models answered here) ->
-- ctxfit (a prompt far over every serving node's context: 400, infergate.routing.ctxfit) ->
-- ratelimit -> cache (exact, then semantic; a hit is answered here, after auth and rate
-- limits, before any node is needed) -> upstream (the request's scheme and node API key,
-- infergate.routing.upstream) -> eligible (no node for the model: 503) ->
-- admission (all saturated: wait, then 429) -> relay (a streamed chat/completions
-- request is driven by the edge over cosockets and ended here, infergate.stream.relay;
-- every other request goes on to the proxy and the balancer phase).
_M.ACCESS = {
    { name = "method", fn = access.step_method },
    { name = "auth", fn = auth.step },
    { name = "body_read", fn = inputguard.step },
    { name = "body", fn = access.step_body },
    { name = "models", fn = models.step },
    { name = "ctxfit", fn = ctxfit.step },
    { name = "ratelimit", fn = ratelimit.step },
    { name = "cache", fn = lookup.step, when = "cache", init = lookup.init },
    { name = "upstream", fn = upstream.step },
    { name = "eligible", fn = access.step_eligible },
    { name = "admission", fn = shed.step_shed },
    { name = "relay", fn = relay.step },
}

-- header_filter_by_lua: "proxy" for the API locations, "error" for the error pages.
_M.HEADER_FILTER = {
    proxy = {
        { name = "node", fn = filters.run },
        { name = "cors", fn = cors.header_filter },
        { name = "cache_capture", fn = capture.header_filter, when = "cache" },
    },
    error = {
        { name = "cors", fn = cors.header_filter },
        { name = "cache_capture", fn = capture.header_filter, when = "cache" },
    },
}

-- body_filter_by_lua of the API locations: progress first (every chunk from the node is
-- proof of life, infergate.routing.stall), before any step rewrites the chunk.
_M.BODY_FILTER = {
    { name = "progress", fn = stall.body_filter },
    { name = "node", fn = filters.body },
    { name = "usage", fn = usage.body_filter },
    { name = "cache_capture", fn = capture.body_filter, when = "cache" },
    { name = "relay_copy", fn = filters.relay_copy },
}

-- log_by_lua of the API locations and the error pages: the cache's part first (it reads
-- the request state the edge's log step ends).
_M.LOG = {
    { name = "cache_store", fn = capture.log, when = "cache" },
    { name = "request", fn = log.run },
}

-- The steps of the running edge: the lists above without the ones switched off.
local active = nil

local function keep(steps, on)
    local out = {}
    for _, s in ipairs(steps) do
        if not s.when or on[s.when] then
            out[#out + 1] = s
        end
    end
    return out
end

-- The active step lists for options `o`: {access, header_filter = {proxy, error},
-- body_filter, log}.
function _M.select(o)
    local on = {}
    for name, fn in pairs(_M.SWITCHES) do
        on[name] = fn(o) and true or false
    end
    return {
        access = keep(_M.ACCESS, on),
        header_filter = { proxy = keep(_M.HEADER_FILTER.proxy, on),
                          error = keep(_M.HEADER_FILTER.error, on) },
        body_filter = keep(_M.BODY_FILTER, on),
        log = keep(_M.LOG, on),
    }
end

local function steps()
    if not active then
        active = _M.select(config.get())
    end
    return active
end

-- Names of the active steps by phase (for tests and the operator).
function _M.names()
    local a = steps()
    local function list(ss)
        local out = {}
        for i, s in ipairs(ss) do
            out[i] = s.name
        end
        return out
    end
    return {
        access = list(a.access),
        header_filter = { proxy = list(a.header_filter.proxy), error = list(a.header_filter.error) },
        body_filter = list(a.body_filter),
        log = list(a.log),
    }
end

-- Modules loaded in init_by_lua so the workers share them (copy-on-write).
local PRELOAD = { "infergate.routing.status", "infergate.redis.sentinel" }

-- init_by_lua, after infergate.core.config.init: selects the steps the options switch on
-- and runs their init (the cache's options). Returns true or nil, err.
function _M.init()
    local ok, o = pcall(config.get)
    if not ok then
        return nil, o
    end
    active = _M.select(o)
    for _, s in ipairs(active.access) do
        if s.init then
            local iok, err = s.init()
            if not iok then
                return nil, err
            end
        end
    end
    for _, name in ipairs(PRELOAD) do
        require(name)
    end
    return true
end

-- init_worker_by_lua: this worker's start (infergate.core.closing: a reload is no
-- shutdown), the snapshot sync timer, the flush timer (writes to Redis), the
-- refresh of the key store's digests (infergate.admission.knownkeys) and, on worker 0,
-- the liveness checks of silent nodes.
function _M.init_worker()
    closing.init_worker()
    snapshot.init_worker()
    flush.init_worker(pool)
    knownkeys.init_worker()
    liveness.init_worker(function()
        return snapshot.refresh().nodes
    end, stall.threshold, stats.inflight)
end

-- access_by_lua (see ACCESS).
function _M.access(route)
    snapshot.refresh()
    local req = reqctx.new(route)
    local list = steps().access
    for i = 1, #list do
        local e = list[i].fn(req)
        if e then
            req.rejected = e.status
            return errors.send(e.status, e.message, e.type, e.code, e.headers, e.param)
        end
    end
end

-- balancer_by_lua: the node choice (pure, no I/O; infergate.routing.balancer).
function _M.balancer()
    return routing_balancer.run()
end

local function run_all(list)
    for i = 1, #list do
        list[i].fn()
    end
end

-- header_filter_by_lua: kind "proxy" (API locations) or "error" (error pages).
function _M.header_filter(kind)
    run_all(steps().header_filter[kind or "proxy"])
end

-- body_filter_by_lua of the API locations.
function _M.body_filter()
    run_all(steps().body_filter)
end

-- log_by_lua of the API locations and the error pages.
function _M.log()
    run_all(steps().log)
end

-- content_by_lua of the error locations (infergate.errorpage).
function _M.error_page(status)
    return errorpage.page(status)
end

return _M
