-- Prometheus metrics of this edge (all workers, since nginx started).
--
-- Counters live in the shared dict infergate_metrics and are bumped with incr (no I/O)
-- from the log phase (log()) and where events happen (breaker_opened()); gauges are read
-- at scrape time. This module only records; GET /metrics on edge.metrics_listen (a
-- separate server {} of the rendered http include) is answered by
-- infergate.metrics.exposition in the text exposition format 0.0.4:
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
--                                                            cache_store | ratelimit_correction |
--                                                            cache_verify)
--   infergate_edge_stream_relay_total{outcome}     counter  streams the edge relays
--                                                            (infergate.stream.relay):
--                                                            completed | retried (a node failed
--                                                            before content, another took over) |
--                                                            continued (a continuation started) |
--                                                            error_event (ended with an SSE error)
--   infergate_edge_request_duration_seconds        histogram  arrival to last byte, seconds
--   infergate_edge_time_to_first_byte_seconds     histogram  arrival to the first byte of a node's
--                                                            2xx answer (a stream's first chunk:
--                                                            its TTFT with the edge's part), s
--   infergate_edge_admission_wait_seconds          histogram  time a request sent to a node waited
--                                                            at the edge for one with room (0:
--                                                            none), s (infergate.admission.shed)
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
local floor = math.floor
local log = ngx.log
local ERR = ngx.ERR

local SEP = "\t"
-- Separator of the parts of a dict key (counter name, labels).
_M.SEP = SEP
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

-- The histograms by the prefix of their dict keys: bucket i is "<prefix><SEP><i>" (not
-- cumulative; NBUCKETS + 1 is +Inf), the sum "<prefix>sum". "hb" (duration) keeps its
-- sum under "hsum".
_M.HISTOGRAMS = {
    { prefix = "hb", sum = "hsum", name = "request_duration_seconds",
      help = "Time from the request's arrival to its last byte, seconds" },
    { prefix = "ft", sum = "ftsum", name = "time_to_first_byte_seconds",
      help = "Time from the request's arrival to the first byte of a node's 2xx answer "
          .. "(a stream's first chunk), seconds" },
    { prefix = "aw", sum = "awsum", name = "admission_wait_seconds",
      help = "Time a request sent to a node waited at the edge for one with room, seconds" },
}

-- Shared-dict keys of the histogram buckets by prefix, built once.
local BUCKET_KEYS = {}
for _, h in ipairs(_M.HISTOGRAMS) do
    local keys = {}
    for i = 1, NBUCKETS + 1 do
        keys[i] = h.prefix .. SEP .. i
    end
    BUCKET_KEYS[h.prefix] = keys
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

-- One observation of s seconds in the histogram of dict-key prefix `prefix`.
local function observe(d, prefix, sum_key, s)
    if s and s >= 0 then
        incr(d, BUCKET_KEYS[prefix][bucket_of(s)])
        if s > 0 then   -- most requests wait 0 s for a slot: one write, not two
            incr(d, sum_key, s)
        end
    end
end

-- Counts one finished request. node: name of the node of the last try, "cache" or
-- "none"; status: HTTP status sent; duration_s: seconds since arrival; tries: number
-- of tries started; cache_result: "hit_exact" | "hit_semantic" | "miss" | "bypass" | nil;
-- ttfb_s: seconds from arrival to the first byte of the node's answer (observed for a
-- 2xx status only); wait_s: seconds it waited at admission (observed when tries > 0).
function _M.request_done(node, status, duration_s, tries, cache_result, ttfb_s, wait_s)
    local d = dict()
    if not d then
        return
    end
    incr(d, "rq" .. SEP .. node .. SEP .. tostring(status))
    if tries and tries > 1 then
        incr(d, "retries", tries - 1)
    end
    observe(d, "hb", "hsum", duration_s)
    if tries and tries > 0 then
        observe(d, "aw", "awsum", wait_s or 0)
        if status >= 200 and status < 300 then
            observe(d, "ft", "ftsum", ttfb_s)
        end
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

-- A relayed stream's event. outcome: "completed" | "retried" | "continued" | "error_event".
function _M.stream_relay(outcome)
    local d = dict()
    if d then
        incr(d, "sr" .. SEP .. tostring(outcome))
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
    local node, tries, cres, ttfb, wait = "none", 0, nil, nil, nil
    local start = ngx_start_time()
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
        ttfb = req.first_byte_at and req.first_byte_at - start
        wait = req.admission_wait_ms and req.admission_wait_ms / 1000
    end
    _M.request_done(node, status, ngx_now() - start, tries, cres, ttfb, wait)
end

-- Every numeric value of the metrics dict by key (empty without the dict), for the
-- exposition (infergate.metrics.exposition). Keys are parts joined by SEP.
function _M.values()
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
    return values
end

return _M
