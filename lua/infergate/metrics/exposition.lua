-- GET /metrics of this edge: the Prometheus text exposition format 0.0.4 of the counters
-- recorded by infergate.core.prometheus (the metric families are listed in its header),
-- with the gauges read at scrape time from the routing state (in-flight and breakers
-- from infergate.routing.stats / infergate.routing.breaker, the snapshot's age and
-- version) and the admission counters (infergate.admission.stats).
--
--   content_by_lua: require("infergate.metrics.exposition").serve()
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local prometheus = require("infergate.core.prometheus")
local snapshot = require("infergate.routing.snapshot")
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")
local affinity = require("infergate.routing.affinity")
local astats = require("infergate.admission.stats")

local _M = {}

local shared = ngx.shared
local tostring = tostring
local tonumber = tonumber
local ipairs = ipairs
local pairs = pairs
local concat = table.concat
local sort = table.sort
local fmt = string.format

local SEP = prometheus.SEP
local P = "infergate_edge_"

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

-- A counter family with one label, one sample per dict key with `prefix`.
local function labelled(out, values, name, label, prefix, help)
    family(out, P .. name, "counter", help)
    for _, r in ipairs(rows(values, prefix)) do
        sample(out, P .. name, label .. '="' .. esc(r[1]) .. '"', r[2])
    end
end

-- The counters of the metrics dict and the admission counters.
local function counters(out, values)
    family(out, P .. "requests_total", "counter",
           "Requests finished, by node of the last try (cache, none) and status sent")
    for _, r in ipairs(rows(values, "rq")) do
        sample(out, P .. "requests_total", 'node="' .. esc(r[1]) .. '",status="' .. esc(r[2]) .. '"', r[3])
    end
    family(out, P .. "retries_total", "counter", "Tries after the first one of a request")
    sample(out, P .. "retries_total", nil, values.retries or 0)
    labelled(out, values, "breaker_opens_total", "node", "bo", "Circuit breaker openings per node")
    family(out, P .. "shed_total", "counter",
           "Requests refused with 429 because every eligible node stayed saturated")
    sample(out, P .. "shed_total", nil, astats.get("shed"))
    family(out, P .. "rate_limited_total", "counter",
           "Requests refused with 429 by a rate limit (token bucket)")
    sample(out, P .. "rate_limited_total", nil, astats.get("rate_limited"))
    labelled(out, values, "cache_requests_total", "result", "cache",
             "Cacheable requests by cache result (hit_exact, hit_semantic, miss, bypass)")
    labelled(out, values, "semantic_lookups_total", "outcome", "sl",
             "Semantic lookups after an exact miss by outcome (hit, miss, busy, error, breaker_open)")
    family(out, P .. "semantic_calls_total", "counter",
           "Calls of the embedder's POST /v1/lookups (lookups grouped per worker)")
    sample(out, P .. "semantic_calls_total", nil, values.scalls or 0)
    family(out, P .. "semantic_call_lookups_total", "counter",
           "Lookups carried by those calls")
    sample(out, P .. "semantic_call_lookups_total", nil, values.slookups or 0)
    local aff = affinity.counts()
    family(out, P .. "affinity_picks_total", "counter",
           "Requests routed by their affinity key: to the key's first node or spilled to a later one")
    sample(out, P .. "affinity_picks_total", 'outcome="first"', aff.first)
    sample(out, P .. "affinity_picks_total", 'outcome="spill"', aff.spill)
    labelled(out, values, "flush_dropped_total", "kind", "fd",
             "Writes to Redis dropped because the worker's flush queue was full, by kind")
    labelled(out, values, "stream_relay_total", "outcome", "sr",
             "Relayed streams: completed, retried (before content), continued, error_event")
end

-- The histograms of infergate.core.prometheus (cumulative buckets, sum, count).
local function histograms(out, values)
    local bounds = prometheus.BUCKETS
    local nb = #bounds
    for _, hist in ipairs(prometheus.HISTOGRAMS) do
        local h = P .. hist.name
        family(out, h, "histogram", hist.help)
        local cum = 0
        for i = 1, nb + 1 do
            cum = cum + (values[hist.prefix .. SEP .. i] or 0)
            local le = i <= nb and num(bounds[i]) or "+Inf"
            if le ~= "+Inf" and not le:find("[.e]") then
                le = le .. ".0"
            end
            sample(out, h .. "_bucket", 'le="' .. le .. '"', cum)
        end
        sample(out, h .. "_sum", nil, values[hist.sum] or 0)
        sample(out, h .. "_count", nil, cum)
    end
end

-- The gauges read now: per-node in-flight and breakers, the snapshot, Redis.
local function gauges(out, now)
    local t = snapshot.refresh()
    family(out, P .. "inflight", "gauge", "Tries in progress on the node from this edge")
    for _, n in ipairs(t.nodes) do
        sample(out, P .. "inflight", 'node="' .. esc(n.name) .. '"', stats.inflight(n.name))
    end
    family(out, P .. "breaker_open", "gauge", "1 while the node's circuit breaker is open or half-open")
    for _, n in ipairs(t.nodes) do
        sample(out, P .. "breaker_open", 'node="' .. esc(n.name) .. '"',
               breaker.state(n.name, now) == "closed" and 0 or 1)
    end
    family(out, P .. "snapshot_age_seconds", "gauge",
           "Seconds since the routing snapshot in use was generated (absent before the first)")
    local age = snapshot.age(t, now)
    if age then
        sample(out, P .. "snapshot_age_seconds", nil, age)
    end
    family(out, P .. "snapshot_version", "gauge", "Version of the routing snapshot in use (0 = static list)")
    sample(out, P .. "snapshot_version", nil, tonumber(t.version) or 0)
    family(out, P .. "redis_up", "gauge", "1 if the last snapshot sync reached Redis")
    local sd = shared[config.DICT_SNAPSHOT]
    sample(out, P .. "redis_up", nil, (sd and sd:get("redis_ok") == true) and 1 or 0)
end

-- The text exposition of this edge's metrics at `now` (epoch seconds).
function _M.render(now)
    local values = prometheus.values()
    local out = {}
    family(out, P .. "info", "gauge",
           "This edge: its edge_id and the folder its configuration was rendered into")
    sample(out, P .. "info", 'edge_id="' .. esc(config.get_or_empty().edge.edge_id or "")
           .. '",config_dir="' .. esc(config.rendered_dir() or "") .. '"', 1)
    counters(out, values)
    histograms(out, values)
    gauges(out, now)
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
    ngx.print(_M.render(ngxapi.now()))
end

return _M
