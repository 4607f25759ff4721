-- Request deadlines (balancer phase, per try) and their 504 answer.
--
-- Every request gets, from [deadlines] or its per-path entry in deadlines.routes
-- (looked up by the exact $uri, e.g. "/v1/embeddings"):
--
--   request_ms      end-to-end deadline, counted from the moment nginx read the request
--                   (ngx.req.start_time(), so time spent in auth, rate limiting and the
--                   admission wait counts); 0 = none
--   stream_idle_ms  longest silence from the node on a streaming request ("stream":
--                   true), before the first chunk and between chunks
--
-- before_try() runs for every try in the balancer and sets that try's timeouts with
-- ngx.balancer.set_timeouts (never I/O; the read timeout, s, is kept in req.read_s):
--
--   connect, send   edge.connect_timeout_ms / send_timeout_ms, capped by the time left
--   read            non-streaming: min(edge.read_timeout_ms, time left to the deadline)
--                   streaming:     min(edge.read_timeout_ms, stream_idle_ms)
--
-- No try starts once the deadline has passed (streams included): the balancer then
-- fails the request with $infergate_reason = "deadline_exceeded". A read that times out
-- closes the connection to the node, so the node can drop the work. The client gets
-- 504 {"type": "timeout", "code": "deadline_exceeded"} (error_page() below), never a
-- hanging connection. A stream whose headers were already sent cannot change its
-- status: after an idle timeout it just ends.
local ngx_balancer = require("ngx.balancer")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_start_time = ngxapi.req_start_time
local ngx_var = ngxapi.var
local reqctx = require("infergate.core.reqctx")
local astats = require("infergate.admission.stats")

local config = require("infergate.core.config")

local _M = {}

local min = math.min
local log = ngx.log
local ERR = ngx.ERR

-- The smallest timeout handed to nginx (s): it takes whole milliseconds.
local MIN_TIMEOUT_S = 0.001
-- The least time (s) left to the deadline for a retry to start: a try whose read timeout
-- the deadline bounded fires a few milliseconds before it (whole milliseconds, a cached
-- clock), and a retry then would be sent to a node only to time out at once, which would
-- then be named (X-Infergate-Node, metrics) for a timeout it had no part in.
_M.RETRY_MIN_S = 0.05

-- The client's own timeout (s), from the headers that say it: X-Request-Timeout (s, any
-- client), X-Stainless-Read-Timeout (s: the OpenAI Python SDK's read timeout, sent with
-- every request: openai-python _base_client.py, seen in openai 3.63.0; default 600) and
-- X-Stainless-Timeout (s: the OpenAI Node SDK's). The smallest that is a number within
-- CLIENT_MIN_S .. CLIENT_MAX_S; nil without one.
_M.CLIENT_MIN_S = 0.1
_M.CLIENT_MAX_S = 86400
local CLIENT_HEADERS = { "http_x_request_timeout", "http_x_stainless_read_timeout",
                         "http_x_stainless_timeout" }

-- A decimal number of seconds ("30", "2.5", ".5"), else nil: Lua's tonumber would also
-- take hex ("0x10"), exponents, "inf" and "nan", which no client means.
local function seconds(raw)
    if raw and (raw:find("^%s*%d+%.?%d*%s*$") or raw:find("^%s*%.%d+%s*$")) then
        return tonumber(raw)
    end
    return nil
end

local function client_timeout_s()
    local best
    for _, name in ipairs(CLIENT_HEADERS) do
        local v = seconds(ngx_var(name))
        if v and v >= _M.CLIENT_MIN_S and v <= _M.CLIENT_MAX_S and (not best or v < best) then
            best = v
        end
    end
    return best
end

-- The deadline (ms) a client timeout of `s` seconds gives: its answer (a 429, a 504)
-- must reach the client before it gives up, so a tenth of it, at most 1 s, is kept back.
function _M.client_ms(s)
    return math.floor((s - min(1, s / 10)) * 1000)
end

-- {at = epoch s | nil, request_ms, idle_s, client (the client's timeout set request_ms)}
-- of the current request (cached in req): the route's deadline, shortened to the
-- client's own timeout when one is sent and shorter (client_timeout_s: what admission
-- predicts against and a 429 answers within, instead of admitting requests the client
-- will have given up on; a stream then need only start within it).
function _M.for_request(req)
    local d = req.deadline
    if d then
        return d
    end
    local o = config.get().deadlines
    local r = o.routes[ngx_var("uri")] or o
    d = { request_ms = r.request_ms, idle_s = r.stream_idle_ms / 1000 }
    local c = client_timeout_s()
    if c then
        local ms = _M.client_ms(c)
        if r.request_ms == 0 or ms < r.request_ms then
            d.request_ms, d.client = ms, true
        end
    end
    if d.request_ms > 0 then
        d.at = ngx_start_time() + d.request_ms / 1000
    end
    req.deadline = d
    return d
end

-- Seconds left before the deadline (nil = no deadline).
function _M.remaining(req, now)
    local d = _M.for_request(req)
    if not d.at then
        return nil
    end
    return d.at - (now or ngx_now())
end

-- The request's whole deadline (s), or nil without one.
function _M.whole_s(req)
    local d = _M.for_request(req)
    return d.at and d.request_ms / 1000 or nil
end

-- The part of a request's own time `tail_s` (its predicted answer time, s) that admission
-- requires to fit before its deadline: all of it, a stream's too, so what is admitted
-- finishes in time for a client whose timeout covers the whole answer; only for a
-- stream whose `tail_s` alone is longer than its whole deadline (answers longer than the
-- deadline, which a client reading a stream lets run on) nothing: it need only start in
-- time, then the idle timeout bounds it. A stream whose deadline the client's timeout set
-- need only start too: those timeouts bound the wait for the answer's head and for each
-- chunk after it, not the whole stream.
function _M.own_s(req, tail_s)
    if req.stream then
        local d = _M.for_request(req)
        if not d.at or d.client or tail_s > d.request_ms / 1000 then
            return 0
        end
    end
    return tail_s
end

-- "its deadline of N ms", and where it came from when the client's timeout set it.
function _M.describe(req)
    local d = _M.for_request(req)
    return "its deadline of " .. d.request_ms .. " ms"
        .. (d.client and " (the timeout the client sent, less a margin)" or "")
end

-- Timeouts (s) of the next try: connect, send, read, bound_by_deadline; or nil when
-- the deadline has passed. o: infergate.core.config options.
function _M.timeouts(req, o, now)
    local d = _M.for_request(req)
    local connect = o.edge.connect_timeout_ms / 1000
    local send = o.edge.send_timeout_ms / 1000
    local read = o.edge.read_timeout_ms / 1000
    local bound = false
    if req.stream and d.idle_s < read then
        read = d.idle_s
    end
    if d.at then
        local left = d.at - now
        if left < MIN_TIMEOUT_S then
            return nil
        end
        connect = min(connect, left)
        send = min(send, left)
        if not req.stream and left < read then
            read = left
            bound = true
        end
    end
    return connect, send, read, bound
end

-- Balancer, before every try: sets the try's timeouts. False when the deadline has
-- passed (no new try may start), or for a retry (`retry` true) when less than
-- RETRY_MIN_S is left.
function _M.before_try(req, o, now, retry)
    local connect, send, read = _M.timeouts(req, o, now)
    if not connect then
        return false
    end
    if retry then
        local d = req.deadline
        if d.at and d.at - now < _M.RETRY_MIN_S then
            return false
        end
    end
    req.read_s = read
    local ok, err = ngx_balancer.set_timeouts(connect, send, read)
    if not ok then
        log(ERR, "infergate: set_timeouts: ", err)
    end
    return true
end

-- Balancer, after a probe of a silent outlier was chosen as the try's node (its TTFB
-- threshold `thr_s`, seconds) with another node left to retry on: the try's read timeout
-- becomes 2 x thr_s when that is shorter. A node still hung then costs the request that
-- wait and the retry has the rest of its time. The node has then been silent for at
-- least FLAG_TTL_FACTOR x thr_s (infergate.routing.outlier) before the probe: one that
-- is slow but alive answers one of the requests it holds, or the probe, within twice its
-- threshold more.
function _M.probe_read(req, o, now, thr_s)
    local connect, send, read = _M.timeouts(req, o, now)
    if not connect then
        return
    end
    local probe = 2 * thr_s
    if probe >= read then
        return
    end
    req.read_s = probe
    local ok, err = ngx_balancer.set_timeouts(connect, send, probe)
    if not ok then
        log(ERR, "infergate: set_timeouts: ", err)
    end
end

-- How early (s) before the deadline a timeout still counts as the deadline's: nginx
-- takes whole milliseconds, and the time cached for the request may be a little old.
local DEADLINE_SLACK_S = 0.02

-- True when the deadline has passed (within DEADLINE_SLACK_S), on a fresh clock.
local function passed(d)
    ngx.update_time()
    return ngx_now() >= d.at - DEADLINE_SLACK_S
end

-- True when a timeout of the request's current try belongs to the deadline, not the
-- node: it fired when the deadline had passed (a read the deadline cut short). Such a
-- timeout is never counted against the node (infergate.routing.balancer,
-- infergate.log): a node generating a long answer is working, not failing. A timeout
-- that fired before (connecting to a node that does not accept, a node silent past
-- edge.read_timeout_ms) is the node's, even when the deadline bound the try's read.
function _M.expired_try(req)
    local d = req.deadline
    if not d or not d.at then
        return false
    end
    return passed(d)
end

-- Balancer: end the request because its deadline passed (answered by error_page()).
function _M.fail()
    local ok = pcall(function() ngx.var.infergate_reason = "deadline_exceeded" end)
    if not ok then
        log(ngx.WARN, "infergate: $infergate_reason is not defined in this location")
    end
    return ngx.exit(ngx.ERROR)
end

-- Error pages: the deadline answer for a 500 from a refused try or a 504 that came
-- from a deadline-bound read. Returns status, type, code, message or nil.
function _M.error_page(status)
    if status ~= 500 and status ~= 504 then
        return nil
    end
    local req = reqctx.get()
    if not req or not req.deadline or not req.deadline.at then
        return nil
    end
    local reason = ngx_var("infergate_reason")
    if (status == 500 and reason == "deadline_exceeded")
        or (status == 504 and passed(req.deadline)) then
        astats.incr("deadline_exceeded")
        return 504, "timeout", "deadline_exceeded",
            "The request did not finish within " .. _M.describe(req) .. "."
    end
    return nil
end

return _M
