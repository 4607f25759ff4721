-- Prometheus metrics of this edge (all workers, since nginx started).
--
-- Counters live in the shared dict infergate_metrics and are bumped with incr (no I/O)
-- from the log phase (log()) and where events happen (breaker_opened()); gauges are read
-- at scrape time. GET /metrics on edge.metrics_listen (a separate server {} of the
-- rendered http include) answers the text exposition format 0.0.4:
--
--   infergate_edge_requests_total{node,status}     counter  requests finished, by the node of
--                                                            their last try ("cache" = answered
--                                                            from the cache, "none" = no node)
--                                                            and the status sent to the client
--   infergate_edge_retries_total                   counter  tries after the first one
--   infergate_edge_breaker_opens_total{node}       counter  circuit breaker openings
--   infergate_edge_shed_total                      counter  429 nodes_saturated (load shedding)
--   infergate_edge_rate_limited_total              counter  429 rate_limit_exceeded
--   infergate_edge_cache_requests_total{result}    counter  hit_exact | hit_semantic | miss | bypass
--   infergate_edge_semantic_lookups_total{outcome} counter  semantic lookups after an exact miss:
--                                                            hit | miss | busy (waited past the
--                                                            budget behind earlier lookups, or
--                                                            timed out just after one answered) |
--                                                            error (no answer, 5xx, not JSON) |
--                                                            breaker_open (skipped)
--   infergate_edge_semantic_calls_total            counter  POST /v1/lookups calls to the embedder
--   infergate_edge_semantic_call_lookups_total     counter  lookups those calls carried (divided
--                                                            by the calls: the mean group size)
--   infergate_edge_affinity_picks_total{outcome}   counter  requests routed by their affinity key
--                                                            (infergate.routing.affinity): first =
--                                                            the key's first node, spill = a later one
--   infergate_edge_flush_dropped_total{kind}       counter  writes to Redis dropped because this
--                                                            worker's flush queue was full
--                                                            (infergate.core.flush; kind =
--                                                            cache_store | ratelimit_correction)
--   infergate_edge_request_duration_seconds        histogram  arrival to last byte, seconds
--   infergate_edge_inflight{node}                  gauge    tries in progress on the node
--   infergate_edge_breaker_open{node}              gauge    1 while the breaker is open or half-open
--   infergate_edge_snapshot_age_seconds            gauge    now - generated_at of the routing
--                                                            snapshot (absent before the first)
--   infergate_edge_snapshot_version                gauge    version routed on (0 = static list)
--   infergate_edge_redis_up                        gauge    1 if the last sync reached Redis
--   infergate_edge_info{edge_id,config_dir}        gauge    1: this edge, and the folder its
--                                                           configuration was rendered into
--
-- shed and rate_limited are the admission counters (infergate.admission.stats);
-- in-flight and breakers come from infergate.routing.stats / infergate.routing.breaker. Without the
-- shared dict (a hand-written config) every hook is a no-op.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_start_time = ngxapi.req_start_time
local ngx_var = ngxapi.var

local _M = {}

_M.DICT = "infergate_metrics"
-- Upper bounds (seconds) of the duration histogram; +Inf is implicit.
_M.BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120 }

local shared = ngx.shared
local type = type
local tostring = tostring
local tonumber = tonumber
local ipairs = ipairs
local pairs = pairs
local concat = table.concat
local sort = table.sort
local fmt = string.format
local floor = math.floor
local log = ngx.log
local ERR = ngx.ERR

local SEP = "\t"
local NBUCKETS = #_M.BUCKETS

local function dict()
    return shared[_M.DICT]
end

local function incr(d, key, n)
    local _, err = d:incr(key, n or 1, 0)
    if err then
        log(ERR, "infergate: metrics counter ", key, ": ", err)
    end
end

-- Shared-dict keys of the histogram buckets, built once.
local BUCKET_KEYS = {}
for i = 1, NBUCKETS + 1 do
    BUCKET_KEYS[i] = "hb" .. SEP .. i
end

-- Index of the first bucket whose bound is >= s (NBUCKETS + 1: none). A binary search
-- without a loop that leaves early: LuaJIT blacklists such a loop and every trace that
-- reaches it, which kept the whole log phase interpreted.
local function bucket_of(s)
    local lo, hi = 1, NBUCKETS + 1     -- the answer lies in [lo, hi]
    local B = _M.BUCKETS
    -- NBUCKETS < 32: five halvings always suffice; extra ones change nothing
    for _ = 1, 5 do
        local mid = floor((lo + hi) / 2)
        if mid <= NBUCKETS and s <= B[mid] then
            hi = mid
        elseif lo < hi then
            lo = mid + 1
        end
    end
    return lo
end
_M._bucket_of = bucket_of

-- Counts one finished request. node: name of the node of the last try, "cache" or
-- "none"; status: HTTP status sent; duration_s: seconds since arrival; tries: number
-- of tries started; cache_result: "hit_exact" | "hit_semantic" | "miss" | "bypass" | nil.
function _M.request_done(node, status, duration_s, tries, cache_result)
    local d = dict()
    if not d then
        return
    end
    incr(d, "rq" .. SEP .. node .. SEP .. tostring(status))
    if tries and tries > 1 then
        incr(d, "retries", tries - 1)
    end
    if duration_s and duration_s >= 0 then
        incr(d, BUCKET_KEYS[bucket_of(duration_s)])
        incr(d, "hsum", duration_s)
    end
    if cache_result then
        incr(d, "cache" .. SEP .. cache_result)
    end
end

-- The duration histogram for the edge report (infergate:v1:edges, field "duration"):
-- {le = upper bounds in seconds, counts = requests per bucket (not cumulative, one more
-- than le: the last is +Inf), sum = seconds}, all since nginx started; nil without the
-- shared dict. Shared-dict reads only.
function _M.duration_report()
    local d = dict()
    if not d then
        return nil
    end
    local counts = {}
    for i = 1, NBUCKETS + 1 do
        counts[i] = d:get("hb" .. SEP .. i) or 0
    end
    return { le = _M.BUCKETS, counts = counts, sum = d:get("hsum") or 0 }
end

-- A node's circuit breaker opened (closed -> open, or a failed half-open probe).
function _M.breaker_opened(node)
    local d = dict()
    if d then
        incr(d, "bo" .. SEP .. node)
    end
end

-- A write to Redis was dropped: the flush queue of the worker was full
-- (infergate.core.flush). kind: what was dropped.
function _M.flush_dropped(kind)
    local d = dict()
    if d then
        incr(d, "fd" .. SEP .. tostring(kind))
    end
end

-- One semantic lookup ended. outcome: "hit" | "miss" | "busy" | "error" | "breaker_open".
function _M.semantic_lookup(outcome)
    local d = dict()
    if d then
        incr(d, "sl" .. SEP .. tostring(outcome))
    end
end

-- One POST /v1/lookups call carrying n lookups was made.
function _M.semantic_call(n)
    local d = dict()
    if d then
        incr(d, "scalls")
        incr(d, "slookups", n)
    end
end

local CACHE_RESULTS = { MISS = "miss", BYPASS = "bypass" }

local function cache_result(c)
    if type(c) ~= "table" then
        return nil
    end
    if c.status == "HIT" then
        return c.match == "semantic" and "hit_semantic" or "hit_exact"
    end
    return CACHE_RESULTS[c.status]
end

-- log_by_lua hook: req is the request state (infergate.core.reqctx) or nil.
function _M.log(req)
    local status = tonumber(ngx_var("status"))
    if not status or status == 0 then
        status = ngx.status or 0
    end
    local node, tries, cres = "none", 0, nil
    if type(req) == "table" then
        local attempts = req.attempts
        tries = attempts and #attempts or 0
        if tries > 0 then
            node = attempts[tries].node or "none"
        end
        cres = cache_result(req.cache)
        if cres == "hit_exact" or cres == "hit_semantic" then
            node = "cache"
        end
    end
    local dur = ngx_now() - ngx_start_time()
    _M.request_done(node, status, dur, tries, cres)
end

-- ------------------------------------------------------------------ exposition

local function esc(v)
    v = tostring(v)
    if v:find('[\\"\n]') then
        v = v:gsub("\\", "\\\\"):gsub('"', '\\"'):gsub("\n", "\\n")
    end
    return v
end

local function num(v)
    if v ~= v then
        return "NaN"
    elseif v == math.huge then
        return "+Inf"
    elseif v == -math.huge then
        return "-Inf"
    end
    if v == math.floor(v) and v > -1e15 and v < 1e15 then
        return fmt("%d", v)
    end
    return fmt("%.15g", v)
end

local function family(out, name, mtype, help)
    out[#out + 1] = "# HELP " .. name .. " " .. help
    out[#out + 1] = "# TYPE " .. name .. " " .. mtype
end

local function sample(out, name, labels, value)
    if labels then
        out[#out + 1] = name .. "{" .. labels .. "} " .. num(value)
    else
        out[#out + 1] = name .. " " .. num(value)
    end
end

-- Sorted {key parts..., value} rows of the dict keys with `prefix`.
local function rows(keys_values, prefix)
    local out = {}
    for key, v in pairs(keys_values) do
        if key:sub(1, #prefix + 1) == prefix .. SEP then
            local parts = {}
            for p in (key:sub(#prefix + 2) .. SEP):gmatch("([^\t]*)\t") do
                parts[#parts + 1] = p
            end
            parts[#parts + 1] = v
            out[#out + 1] = parts
        end
    end
    sort(out, function(a, b)
        for i = 1, #a - 1 do
            if a[i] ~= b[i] then
                return a[i] < b[i]
            end
        end
        return false
    end)
    return out
end

-- The text exposition of this edge's metrics at `now` (epoch seconds).
function _M.render(now)
    local d = dict()
    local values = {}
    if d then
        for _, key in ipairs(d:get_keys(0)) do
            local v = d:get(key)
            if type(v) == "number" then
                values[key] = v
            end
        end
    end
    local snapshot = require("infergate.routing.snapshot")
    local stats = require("infergate.routing.stats")
    local breaker = require("infergate.routing.breaker")
    local astats = require("infergate.admission.stats")
    local out = {}
    local p = "infergate_edge_"

    family(out, p .. "info", "gauge",
           "This edge: its edge_id and the folder its configuration was rendered into")
    sample(out, p .. "info", 'edge_id="' .. esc(config.get_or_empty().edge_id or "")
           .. '",config_dir="' .. esc(config.rendered_dir() or "") .. '"', 1)

    family(out, p .. "requests_total", "counter",
           "Requests finished, by node of the last try (cache, none) and status sent")
    for _, r in ipairs(rows(values, "rq")) do
        sample(out, p .. "requests_total", 'node="' .. esc(r[1]) .. '",status="' .. esc(r[2]) .. '"', r[3])
    end
    family(out, p .. "retries_total", "counter", "Tries after the first one of a request")
    sample(out, p .. "retries_total", nil, values.retries or 0)
    family(out, p .. "breaker_opens_total", "counter", "Circuit breaker openings per node")
    for _, r in ipairs(rows(values, "bo")) do
        sample(out, p .. "breaker_opens_total", 'node="' .. esc(r[1]) .. '"', r[2])
    end
    family(out, p .. "shed_total", "counter",
           "Requests refused with 429 because every eligible node stayed saturated")
    sample(out, p .. "shed_total", nil, astats.get("shed"))
    family(out, p .. "rate_limited_total", "counter",
           "Requests refused with 429 by a rate limit (token bucket)")
    sample(out, p .. "rate_limited_total", nil, astats.get("rate_limited"))
    family(out, p .. "cache_requests_total", "counter",
           "Cacheable requests by cache result (hit_exact, hit_semantic, miss, bypass)")
    for _, r in ipairs(rows(values, "cache")) do
        sample(out, p .. "cache_requests_total", 'result="' .. esc(r[1]) .. '"', r[2])
    end
    family(out, p .. "semantic_lookups_total", "counter",
           "Semantic lookups after an exact miss by outcome (hit, miss, busy, error, breaker_open)")
    for _, r in ipairs(rows(values, "sl")) do
        sample(out, p .. "semantic_lookups_total", 'outcome="' .. esc(r[1]) .. '"', r[2])
    end
    family(out, p .. "semantic_calls_total", "counter",
           "Calls of the embedder's POST /v1/lookups (lookups grouped per worker)")
    sample(out, p .. "semantic_calls_total", nil, values.scalls or 0)
    family(out, p .. "semantic_call_lookups_total", "counter",
           "Lookups carried by those calls")
    sample(out, p .. "semantic_call_lookups_total", nil, values.slookups or 0)
    local aff = require("infergate.routing.affinity").counts()
    family(out, p .. "affinity_picks_total", "counter",
           "Requests routed by their affinity key: to the key's first node or spilled to a later one")
    sample(out, p .. "affinity_picks_total", 'outcome="first"', aff.first)
    sample(out, p .. "affinity_picks_total", 'outcome="spill"', aff.spill)
    family(out, p .. "flush_dropped_total", "counter",
           "Writes to Redis dropped because the worker's flush queue was full, by kind")
    for _, r in ipairs(rows(values, "fd")) do
        sample(out, p .. "flush_dropped_total", 'kind="' .. esc(r[1]) .. '"', r[2])
    end

    local h = p .. "request_duration_seconds"
    family(out, h, "histogram", "Time from the request's arrival to its last byte, seconds")
    local cum = 0
    for i = 1, NBUCKETS + 1 do
        cum = cum + (values["hb" .. SEP .. i] or 0)
        local le = i <= NBUCKETS and num(_M.BUCKETS[i]) or "+Inf"
        if le ~= "+Inf" and not le:find("[.e]") then
            le = le .. ".0"
        end
        sample(out, h .. "_bucket", 'le="' .. le .. '"', cum)
    end
    sample(out, h .. "_sum", nil, values.hsum or 0)
    sample(out, h .. "_count", nil, cum)

    local t = snapshot.refresh()
    family(out, p .. "inflight", "gauge", "Tries in progress on the node from this edge")
    for _, n in ipairs(t.nodes) do
        sample(out, p .. "inflight", 'node="' .. esc(n.name) .. '"', stats.inflight(n.name))
    end
    family(out, p .. "breaker_open", "gauge", "1 while the node's circuit breaker is open or half-open")
    for _, n in ipairs(t.nodes) do
        sample(out, p .. "breaker_open", 'node="' .. esc(n.name) .. '"',
               breaker.state(n.name, now) == "closed" and 0 or 1)
    end
    family(out, p .. "snapshot_age_seconds", "gauge",
           "Seconds since the routing snapshot in use was generated (absent before the first)")
    local age = snapshot.age(t, now)
    if age then
        sample(out, p .. "snapshot_age_seconds", nil, age)
    end
    family(out, p .. "snapshot_version", "gauge", "Version of the routing snapshot in use (0 = static list)")
    sample(out, p .. "snapshot_version", nil, tonumber(t.version) or 0)
    family(out, p .. "redis_up", "gauge", "1 if the last snapshot sync reached Redis")
    local sd = shared[config.DICT_SNAPSHOT]
    sample(out, p .. "redis_up", nil, (sd and sd:get("redis_ok") == true) and 1 or 0)
    out[#out + 1] = ""
    return concat(out, "\n")
end

-- content_by_lua of GET /metrics.
function _M.serve()
    local m = ngx.req.get_method()
    if m ~= "GET" and m ~= "HEAD" then
        ngx.status = 405
        ngx.header["Allow"] = "GET, HEAD"
        ngx.header["Content-Type"] = "text/plain"
        ngx.say("Use GET on /metrics.")
        return ngx.exit(ngx.HTTP_OK)
    end
    ngx.header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
    ngx.header["Cache-Control"] = "no-store"
    ngx.print(_M.render(ngx_now()))
end

return _M
