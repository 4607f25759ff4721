-- log_by_lua: closes the request's open attempt (in-flight down, latency and failure
-- EWMA, breaker), exactly once, whatever happened: success, failed last try, client
-- abort, or an error page after the upstream gave up. Earlier attempts were closed by
-- the balancer when it picked the next node.
local reqctx = require("infergate.core.reqctx")
local stats = require("infergate.routing.stats")
local admission = require("infergate.admission.shed")
local metrics = require("infergate.core.prometheus")

local _M = {}

local tonumber = tonumber

-- Last entry of a "$upstream_*" list ("502, 504 : 200" -> "200").
local function last_entry(v)
    if not v or v == "" then
        return nil
    end
    return v:match("([^,:%s]+)%s*$")
end
_M.last_entry = last_entry

-- outcome of the final attempt from nginx's view of it
local function outcome()
    local status = tonumber(last_entry(ngx.var.upstream_status))
    if not status then
        -- no answer from the node: connect/read error, or the client left first
        if tonumber(ngx.var.status) == 499 then
            return "aborted"
        end
        return "fail"
    end
    if status == 429 then
        return "busy"
    end
    if status >= 500 then
        return "fail"
    end
    return "ok", status
end

function _M.run()
    local req = reqctx.get()
    metrics.log(req) -- Prometheus counters (infergate.core.prometheus), shared-dict incr only
    if not req then
        return
    end
    reqctx.finish(req)
    admission.log(req) -- token-usage correction, handed to a timer
    local attempts = req.attempts
    local n = #attempts
    if n == 0 then
        return
    end
    local now = ngx.now()
    local last = attempts[n]
    if not last.closed then
        local result, status = outcome()
        if req.invalid_answer then
            result = "fail" -- not HTTP (see infergate.filters)
        end
        local latency_ms
        if result == "ok" and status < 300 then
            local rt = tonumber(last_entry(ngx.var.upstream_response_time))
            if rt then
                latency_ms = rt * 1000
            end
        end
        stats.close_attempt(last, result, now, latency_ms)
    end
    for i = 1, n - 1 do
        -- normally closed by the balancer already
        stats.close_attempt(attempts[i], "aborted", now)
    end
end

return _M
