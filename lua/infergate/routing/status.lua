-- content_by_lua of GET /infergate/status (local only): this edge's routing view.
--
-- {"edge_id", "config_dir" (folder the running configuration was rendered into, null
--  when unknown), "worker_pid", "now",
--  "snapshot": {"source": "redis"|"static", "version", "generated_at", "fetched_at",
--               "age_s", "stale", "leader", "redis_ok", "redis_error", "nodes"},
--  "inflight_total",
--  "admission": {"auth_rejected", "auth_unavailable", "auth_throttled", "auth_kept",
--                "auth_store_missing", "auth_static", "auth_wait_expired",
--                "rate_limited", "limits_local",
--                "shed", "deadline_exceeded", "waiting", "held"}
--                                                 (infergate.admission.stats)
--  "nodes": [{"name", "host", "port", "state", "healthy", "weight", "effective_weight",
--             "max_concurrency", "slots" (known hard limit, null = none), "score",
--             "saturated", "eligible", "inflight", "others" (others' requests its
--             metrics show while this edge has none: infergate.routing.others),
--             "requests", "failures", "breaker", "consecutive_failures",
--             "latency_ewma_ms", "failure_rate", "models" (served model ids, null =
--             unknown), "models_any" (also takes a model no node lists: a single-model
--             llama.cpp server), "outlier" (a TTFB outlier: infergate.routing.outlier),
--             "stalled" (no byte while mid-stream, or requests in flight and no byte since a
--             liveness check got no answer: infergate.routing.stall),
--             "stall_threshold_s" (how long the node may send no byte mid-stream before
--             it is found stalled: max(edge.stall_min_s, edge.stall_gap_factor x the p90
--             of its answers' largest chunk gap)),
--             "ttfb_p90_s" ({"stream", "plain"}: p90 time to first byte, null = none),
--             "learned_concurrency" (infergate.routing.speed, null before a sample),
--             "service_s" (its service time for an answer of the mean length, s,
--             infergate.routing.speed; null before three unqueued answers),
--             "expected_s" (predicted completion of one more request, s; null likewise)}]}
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local config = require("infergate.core.config")
local snapshot = require("infergate.routing.snapshot")
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")
local errors = require("infergate.core.errors")
local outlier = require("infergate.routing.outlier")
local speed = require("infergate.routing.speed")
local others = require("infergate.routing.others")
local stall = require("infergate.routing.stall")

local _M = {}

local null = cjson.null
local ipairs = ipairs

local function opt(v)
    if v == nil then
        return null
    end
    return v
end

function _M.report(now)
    local t = snapshot.refresh()
    local nodes = {}
    local total = 0
    for i, n in ipairs(t.nodes) do
        local inflight = stats.inflight(n.name)
        total = total + inflight
        local lat = stats.latency_ewma_ms(n.name)
        local br = breaker.state(n.name, now)
        nodes[i] = {
            name = n.name,
            host = opt(n.host),
            port = n.port,
            state = n.state,
            healthy = n.healthy,
            weight = n.weight,
            effective_weight = n.effective_weight,
            max_concurrency = n.max_concurrency,
            slots = opt(n.slots),
            score = opt(n.score),
            saturated = n.saturated,
            eligible = (n.addr ~= nil and n.healthy and n.state == "active"
                        and breaker.allow(n.name, now)) and true or false,
            inflight = inflight,
            others = others.count(n, now, inflight),
            requests = stats.requests(n.name),
            failures = stats.failures(n.name),
            breaker = br,
            consecutive_failures = breaker.consecutive_failures(n.name),
            latency_ewma_ms = opt(lat),
            failure_rate = math.floor(stats.failure_rate(n.name, now) * 1000 + 0.5) / 1000,
            models = n.models and n.models.list or null,
            models_any = (n.models and n.models.any) == true,
            outlier = outlier.flagged(n.name),
            stalled = stall.flagged(n.name, inflight),
            stall_threshold_s = stall.threshold(n.name),
            ttfb_p90_s = { stream = opt(outlier.p90(n.name, true)),
                           plain = opt(outlier.p90(n.name, false)) },
            learned_concurrency = opt(speed.learned(n.name)),
            service_s = opt(speed.service_s(n.name)),
            expected_s = opt(speed.expected_s(n)),
        }
    end
    return {
        edge_id = config.get().edge.edge_id,
        config_dir = opt(config.rendered_dir()),
        worker_pid = ngx.worker.pid(),
        now = now,
        snapshot = snapshot.info(now),
        inflight_total = total,
        admission = require("infergate.admission.stats").all(),
        nodes = nodes,
    }
end

-- JSON of a report; an empty node list stays an array (Debian's lua-cjson has no
-- array_mt and would write {}).
function _M.encode(report)
    if #report.nodes > 0 then
        return cjson.encode(report)
    end
    report.nodes = false
    local text = cjson.encode(report)
    return (text:gsub('"nodes":false', '"nodes":[]', 1))
end

function _M.run()
    local m = ngx.req.get_method()
    if m ~= "GET" and m ~= "HEAD" then
        return errors.send(405, "Use GET on " .. ngx_var("uri") .. ".", nil, nil, { Allow = "GET, HEAD" })
    end
    ngx.header["Content-Type"] = "application/json"
    ngx.header["Cache-Control"] = "no-store"
    ngx.say(_M.encode(_M.report(ngx_now())))
end

return _M
