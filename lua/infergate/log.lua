-- log_by_lua: closes the request's open attempt (in-flight down, latency and failure
-- EWMA, breaker), exactly once, whatever happened: success, failed last try, client
-- abort, or an error page after the upstream gave up. Earlier attempts were released by
-- the balancer when it picked the next node; a retried 500 was only held there and is
-- settled here (see infergate.routing.stats).
--
-- A request's own fault never counts against a node:
--   4xx answers                          ok (the node answered what it was sent)
--   404, 405, 501                        unserved: the node does not serve the route
--                                        (e.g. /v1/embeddings on a chat-only server)
--   the same 500 on two nodes            neutral, both (a body every node fails on)
--   a timeout at the request's deadline  neutral (the node was working on it)
-- A node's fault: connect error or reset, a timeout before the first byte (for a
-- stream, before its first chunk: headers alone do not count), bytes that are not HTTP,
-- a 502/503/504 answer, a body cut short of its Content-Length, and a 500 that another
-- node did not repeat (the held 500 of an earlier try is a failure when a later node
-- answered the request).
local reqctx = require("infergate.core.reqctx")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local stats = require("infergate.routing.stats")
local admission = require("infergate.admission.shed")
local metrics = require("infergate.core.prometheus")
local deadline = require("infergate.admission.deadline")
local speed = require("infergate.routing.speed")
local affinity = require("infergate.routing.affinity")
local outlier = require("infergate.routing.outlier")
local usage = require("infergate.admission.usage")

local _M = {}

local tonumber = tonumber

local find = string.find

-- Last entry of a "$upstream_*" list ("502, 504 : 200" -> "200"). A single entry (one
-- try, the usual case) is returned as it is, without a pattern match.
local function last_entry(v)
    if not v or v == "" then
        return nil
    end
    if not find(v, ",", 1, true) and not find(v, ":", 1, true) and not find(v, " ", 1, true) then
        return v
    end
    return v:match("([^,:%s]+)%s*$")
end
_M.last_entry = last_entry

-- How much sooner (s) than the try's read timeout an answer's end still counts as that
-- timeout: nginx measures whole milliseconds.
local READ_SLACK_S = 0.01

-- Routes a node may not serve: no verdict on its health.
local UNSERVED = { [404] = true, [405] = true, [501] = true }
_M.UNSERVED = UNSERVED

-- Whether the last node's answer body ended before its Content-Length (the node closed
-- the connection early: nginx logs "upstream prematurely closed connection"). The
-- client got the same short body that plain nginx would pass on, since its headers
-- were already sent; the node must not count it as an answer (a fast short answer would
-- also make it look like the fastest node). $upstream_response_length: the body bytes
-- read from the node; $upstream_http_content_length: the node's own header.
local function cut_short()
    local want = tonumber(ngx_var("upstream_http_content_length"))
    if not want then
        return false
    end
    local got = tonumber(last_entry(ngx_var("upstream_response_length")))
    return got ~= nil and got < want
end

-- Outcome of the final attempt from nginx's view of it: result, status.
local function outcome(req)
    if req.relay then
        return "aborted" -- the relay closes every attempt it ends; one left open: the client left
    end
    local status = tonumber(last_entry(ngx_var("upstream_status")))
    local client_left = ngx.status == 499
    if not status then
        -- no answer from the node: connect/read error, or the client left first
        if client_left then
            return "aborted"
        end
        return "fail"
    end
    if req.invalid_answer then
        return "fail" -- not HTTP (see infergate.filters)
    end
    local header = last_entry(ngx_var("upstream_header_time"))
    if header == nil or header == "-" then
        -- no HTTP header from the node: connect error, reset or a timeout before the
        -- first byte (nginx's own 502/504)
        if client_left then
            return "aborted"
        end
        if status == 504 and deadline.expired_try(req) then
            return "neutral", status
        end
        return "fail", status
    end
    if req.first_chunk_wait and status < 300 then
        -- a stream whose node sent its headers and then no chunk (infergate.filters):
        -- silent until the try's read timeout, the node failed (an engine hung behind a
        -- live HTTP server); ended sooner, the client left
        local rt = tonumber(last_entry(ngx_var("upstream_response_time")))
        local read_s = req.read_s
        if rt and read_s and rt >= read_s - READ_SLACK_S then
            return "fail", 504
        end
        return "aborted"
    end
    if status == 429 then
        return "busy", status
    end
    if UNSERVED[status] then
        return "unserved", status
    end
    if status >= 500 then
        return "fail", status
    end
    if status < 300 and not client_left and cut_short() then
        return "fail", 502
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
    admission.log(req) -- token-usage correction, into the flush queue (infergate.core.flush)
    if req.affinity_live then
        affinity.untrack(req.affinity) -- the key's requests in flight (infergate.routing.affinity)
    end
    local attempts = req.attempts
    local n = #attempts
    if n == 0 then
        return
    end
    local now = ngx_now()
    local last = attempts[n]
    local result = "aborted"
    if not last.closed then
        local status
        result, status = outcome(req)
        if result == "fail" and status == 500 then
            -- a 500 the node wrote, with no later node to answer the request past it: no
            -- evidence against the node (the same 500 on two nodes, or one node's 500 to
            -- input it cannot take, as llama-server's to an image part): neutral, as the
            -- stream relay settles it (infergate.stream.leg); a node that fails what
            -- another node answers is counted through its held 500 below
            result = "neutral"
        end
        local latency_ms
        if result == "ok" and status < 300 then
            local rt = tonumber(last_entry(ngx_var("upstream_response_time")))
            if rt then
                latency_ms = rt * 1000
            end
        end
        stats.close_attempt(last, result, now, latency_ms)
        -- learned concurrency and service time (infergate.routing.speed)
        speed.observe(last, latency_ms, usage.completion_tokens(req))
    end
    outlier.finished(last, now) -- an unanswered probe of a hung node backs it off
    for i = 1, n - 1 do
        local att = attempts[i]
        if att.held then
            -- a 500 retried elsewhere: the node's fault only if a later node answered
            stats.close_attempt(att, result == "ok" and "fail" or "neutral", now)
        else
            -- normally closed by the balancer already
            stats.close_attempt(att, "aborted", now)
        end
    end
end

return _M
