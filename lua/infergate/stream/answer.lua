-- A node's answer that is not an SSE stream, for the relay (infergate.stream.leg): a
-- request that is not a stream (edge.answer_relay) answered whole, or an error answer
-- to any request. Read whole (at most ANSWER_MAX bytes), kept in r.last_answer, passed
-- to the client by send() once it is the request's answer. The leg's connection of a
-- request that is not a stream is kept for the next one (keep()) when its answer was
-- read to its Content-Length and the node did not close it, as nginx's upstream
-- keepalive pool keeps the proxy path's.
--
--   read(r, lg, head, sock)  reads the body; sets r.last_answer = {status, body, node,
--                            content_type, headers} and lg.verdict / lg.why / lg.final /
--                            lg.timeout as the balancer's verdicts (infergate.routing.tries)
--   send(r, a, node_name)    answer `a` to the client (ngx.print; the caller exits)
--   keep(r, lg, head, sock)  the connection back to the pool, or closed
--   connect(r, sock, node)   sock:connect into the pool of the node's relayed answers
--   write(r, piece)          `piece` to the client now (false: the client left)
local outlier = require("infergate.routing.outlier")
local stall = require("infergate.routing.stall")
local stats = require("infergate.routing.stats")
local filters = require("infergate.filters")
local http = require("infergate.stream.http")
local legheaders = require("infergate.stream.legheaders")
local ngxapi = require("infergate.core.ngxapi")

local _M = {}

local concat = table.concat
local ngx_now = ngxapi.now
local lower = string.lower

-- Most bytes of a node's answer that is not a stream read and passed on.
_M.ANSWER_MAX = 16 * 1024 * 1024
-- How long (ms) an idle connection of the pool stays open: as the proxy path's
-- upstream keepalive_timeout (nginx/infergate-http.conf.j2).
_M.IDLE_MS = 60000

-- Sends `piece` to the client now; a client that left marks r.client_gone (false then).
function _M.write(r, piece)
    ngx.print(piece)
    local ok, err = ngx.flush(true)
    if not ok then
        r.client_gone = err or true
        return false
    end
    return true
end

-- A whole answer longer than ANSWER_MAX goes on as it comes, as the proxy path passes
-- it: its head and what was read, then the rest piece by piece; it cannot move to
-- another node past that, and a node that fails in its middle cuts it (the client's
-- connection is closed, r.client_gone, as nginx closes it).
local function spill(r, lg, head, sock, parts)
    legheaders.pass_headers(head.list)
    ngx.status = head.status
    ngx.header["Content-Type"] = head.headers["content-type"] or "application/json"
    ngx.header["Content-Length"] = head.length -- (not a chunked answer's Content-Length)
    ngx.header["X-Infergate-Node"] = lg.node.name
    r.sent, r.finished = true, true
    local data = concat(parts)
    while data ~= "" do
        if not _M.write(r, data) then
            return
        end
        local err
        data, err = http.read_body(head, sock)
        if not data then
            lg.verdict, lg.why, lg.timeout = "fail", "answer cut: " .. (err or "?"),
                err == "timeout"
            r.client_gone = "answer cut"
            return
        end
        stall.byte(r.req, ngx_now())
    end
    lg.verdict, lg.why = "ok", "status " .. head.status
end

function _M.read(r, lg, head, sock)
    local whole = not r.req.stream and head.status < 300
    if whole then
        -- the answer's head is its first byte (as the proxy path's header filter counts it)
        local now = ngx_now()
        stats.probe_answered(lg.att)
        outlier.first_byte(r.req, now)
        stall.byte(r.req, now)
    end
    local parts, size = {}, 0
    while size < _M.ANSWER_MAX do
        local data, err = http.read_body(head, sock)
        if not data then -- cut short: not passed on as if whole
            lg.verdict, lg.why, lg.timeout = "fail", "answer cut: " .. (err or "?"),
                err == "timeout"
            return
        end
        if data == "" then
            break
        end
        if whole then
            stall.byte(r.req, ngx_now())
        end
        parts[#parts + 1] = data
        size = size + #data
    end
    if whole and not head.done then
        return spill(r, lg, head, sock, parts)
    end
    local status = head.status
    r.last_answer = { status = status, body = concat(parts), node = lg.node.name,
                      content_type = head.headers["content-type"], headers = head.list }
    if status == 429 then
        lg.verdict = "busy"
    elseif status >= 500 then
        lg.verdict = "fail"
    else
        -- the node answered what it was sent (a 4xx): no other node would do better
        lg.verdict = (status == 404 or status == 405 or status == 501) and "unserved" or "ok"
        lg.final = true
    end
    lg.why = "status " .. status
end

-- Answer `a` (r.last_answer) to the client; an error answer that is not JSON is wrapped
-- as the proxy path's header filter does (infergate.filters.error_json).
function _M.send(r, a, node_name)
    r.req.relay_answer_status = a.status -- a refusal costs no token (settlement)
    legheaders.pass_headers(a.headers)
    ngx.status = a.status
    local ctype, body = a.content_type, a.body
    if a.status >= 400 and not (ctype and lower(ctype):find("json", 1, true))
            and not ngx.header["Content-Encoding"] then
        ctype, body = "application/json", filters.error_json(a.status, node_name, body) .. "\n"
    end
    ngx.header["X-Infergate-Node"] = node_name
    r.sent = true
    if a.status == 204 or a.status == 304 then -- no body: the node's type only, no length
        ngx.header["Content-Type"] = ctype -- (RFC 9110 8.6, as the proxy passes them)
        return
    end
    ngx.header["Content-Type"] = ctype or "application/json"
    ngx.header["Content-Length"] = #body
    ngx.print(body)
end

function _M.connect(r, sock, node)
    return sock:connect(node.addr, node.port, {
        pool = "infergate-relay:" .. node.addr .. ":" .. node.port,
        pool_size = r.o.edge.keepalive,
    })
end

function _M.keep(r, lg, head, sock)
    if r.req.stream or not head or not head.done or head.chunked or lg.verdict == "fail" then
        return sock:close()
    end
    local conn = lower(head.headers.connection or "")
    if conn:find("close", 1, true) or head.http10 and not conn:find("keep-alive", 1, true) then
        return sock:close() -- HTTP/1.0 closes unless it says keep-alive
    end
    local ok = sock:setkeepalive(_M.IDLE_MS)
    if not ok then
        sock:close()
    end
end

return _M
